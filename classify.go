package idem

import "net/http"

// A Verdict is what a [Transport.Classify] function says one attempt's
// outcome calls for. The zero value, VerdictDefault, keeps the Transport's
// own decision (the table in README.md, "Retry rules").
type Verdict int

const (
	// VerdictDefault keeps the Transport's own decision.
	VerdictDefault Verdict = iota
	// VerdictRetry retries with the same key and body after a backoff
	// wait (or the response's Retry-After), spending an attempt and the
	// retry budget.
	VerdictRetry
	// VerdictStop ends the operation: the response is returned as it
	// came, and the error in a [*RetryError] with the key for a keyed
	// request or after a retry, else as it came.
	VerdictStop
	// VerdictConflict means the first request with the key is still
	// running: the Transport waits and asks again with the same key, on
	// the conflict budget, as for a 409, and ends with an
	// [*InProgressError] if it cannot. It applies to a keyed request's
	// response; for an error or an unkeyed request it is taken as
	// VerdictRetry.
	VerdictConflict
	// VerdictKeyReuse means the key was used for a different request: the
	// operation ends with a [*KeyReuseError] holding the response's
	// problem details, as for a 422. It applies to a keyed request's
	// response; for an error or an unkeyed request it is taken as
	// VerdictStop.
	VerdictKeyReuse
)

// classify applies t.Classify, if set, to an attempt's outcome: it returns
// the verdict to act on and the reason to report.
func (op *operation) classify(resp *http.Response, err error) (verdict, string) {
	v, reason := decide(op.keyed, resp, err)
	if op.t.Classify == nil {
		return v, reason
	}
	override := op.t.Classify(resp, err)
	applies := op.keyed && resp != nil
	switch {
	case override == VerdictRetry, override == VerdictConflict && !applies:
		v = retry
	case override == VerdictStop, override == VerdictKeyReuse && !applies:
		v = done
	case override == VerdictConflict:
		v = conflict
	case override == VerdictKeyReuse:
		v = keyReuse
	default:
		return v, reason
	}
	return v, reason + " (Classify)"
}
