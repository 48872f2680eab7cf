package idem

import "net/http"

// A Verdict is what a [Transport.Classify] function says one attempt's
// outcome calls for. The zero value, VerdictDefault, keeps the Transport's
// own decision (the table in docs/retries.md, "Retry rules").
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
	// VerdictKeyExpired means the server refused the request because it
	// was first sent longer ago than the server keeps keys (Azure's 412
	// with Repeatability-Result: rejected, say): the operation ends with a
	// [*KeyExpiredError] holding the response's problem details, as for
	// idem's own 410. It applies to a keyed request's response; for an
	// error or an unkeyed request it is taken as VerdictStop.
	VerdictKeyExpired
)

// classify decides what an attempt's outcome calls for: the table
// (decide), overridden by the Provider's verdict on a response of status
// 400 or more, overridden in turn by t.Classify, if set. It returns the
// verdict to act on and the reason to report.
func (op *operation) classify(resp *http.Response, err error) (verdict, string) {
	v, reason := decide(op.keyed, resp, err)
	if resp != nil && resp.StatusCode >= 400 && op.t.Provider.Classify != nil {
		v, reason = op.override(op.providerVerdict(resp), resp, v, reason, op.t.Provider.name()) // provider.go
	}
	if op.t.Classify != nil {
		v, reason = op.override(op.t.Classify(resp, err), resp, v, reason, "Classify")
	}
	return v, reason
}

// override returns the verdict to act on when by (a Provider, or Classify)
// says o of an outcome the Transport judged v: v itself for
// VerdictDefault, else what o means for this outcome, with by named in the
// reason.
func (op *operation) override(o Verdict, resp *http.Response, v verdict, reason, by string) (verdict, string) {
	applies := op.keyed && resp != nil
	switch {
	case o == VerdictRetry, o == VerdictConflict && !applies:
		v = retry
	case o == VerdictStop, (o == VerdictKeyReuse || o == VerdictKeyExpired) && !applies:
		v = done
	case o == VerdictConflict:
		v = conflict
	case o == VerdictKeyReuse:
		v = keyReuse
	case o == VerdictKeyExpired:
		v = keyExpired
	default:
		return v, reason
	}
	return v, reason + " (" + by + ")"
}
