package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/idemkit/idem"

	"github.com/idemkit/idem/internal/httpstatus"
)

// eventKind says what a line of a timeline is.
type eventKind int

const (
	attemptEvent eventKind = iota // one attempt of a client operation
	faultEvent                    // a failure the runner injected
	serverEvent                   // a warning the server logged (-v only)
	noteEvent                     // what the scenario does between operations
)

// event is one line of a scenario's timeline.
type event struct {
	at   time.Duration // since the scenario started
	kind eventKind
	op   string // the client operation, for attempts

	// For attempts:
	n       int    // attempt number, from 1
	key     string // the idempotency key sent; "" for none
	outcome string // status line or error
	next    string // what follows: "retry in 48ms (backoff)", "done", …
	same    string // next without the wait: attempts equal in op, outcome and same are folded

	text string // for the other kinds
}

// timeline records what happens in one scenario, from the client's
// OnAttempt hook, the fault injector and the server's log. It is safe for
// concurrent use: a scenario's operations may run at once.
type timeline struct {
	start time.Time

	mu     sync.Mutex
	events []event
}

func newTimeline() *timeline { return &timeline{start: time.Now()} }

// restart makes the timeline count from now.
func (tl *timeline) restart() {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	tl.start = time.Now()
}

func (tl *timeline) add(e event) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	e.at = time.Since(tl.start)
	tl.events = append(tl.events, e)
}

// attempt records one attempt reported by idem.Transport.OnAttempt, under
// the operation label carried by the request's context (see withOp).
func (tl *timeline) attempt(a idem.Attempt) {
	op := "pay"
	if a.Request != nil {
		op = opFrom(a.Request.Context())
	}
	next, same := "done", "done"
	switch {
	case a.Retry:
		next = fmt.Sprintf("retry in %s (%s)", a.Wait.Round(time.Millisecond), a.Reason)
		same = "retry (" + a.Reason + ")"
	case a.Reason != "" && (a.Response == nil || a.Reason != a.Response.Status):
		next = "stop: " + a.Reason
		same = next
	}
	tl.add(event{kind: attemptEvent, op: op, n: a.Number, key: a.Key,
		outcome: outcome(a.Response, a.Err), next: next, same: same})
}

// rawAttempt records an attempt of a client that does not use idem.
func (tl *timeline) rawAttempt(op string, n int, key string, resp *http.Response, err error, next string) {
	tl.add(event{kind: attemptEvent, op: op, n: n, key: key, outcome: outcome(resp, err), next: next, same: next})
}

func (tl *timeline) fault(format string, args ...any) {
	tl.add(event{kind: faultEvent, text: fmt.Sprintf(format, args...)})
}

func (tl *timeline) note(format string, args ...any) {
	tl.add(event{kind: noteEvent, text: fmt.Sprintf(format, args...)})
}

// snapshot returns the events in time order.
func (tl *timeline) snapshot() []event {
	tl.mu.Lock()
	events := slices.Clone(tl.events)
	tl.mu.Unlock()
	slices.SortStableFunc(events, func(a, b event) int { return int(a.at - b.at) })
	return events
}

// count returns the number of attempts for which match is true.
func (tl *timeline) count(match func(event) bool) int {
	n := 0
	for _, e := range tl.snapshot() {
		if e.kind == attemptEvent && match(e) {
			n++
		}
	}
	return n
}

// keys returns the number of distinct keys the attempts were sent with.
func (tl *timeline) keys() int {
	seen := make(map[string]bool)
	for _, e := range tl.snapshot() {
		if e.kind == attemptEvent {
			seen[e.key] = true
		}
	}
	return len(seen)
}

// outcome names what an attempt got: its status line, or its error as a
// person would say it.
func outcome(resp *http.Response, err error) string {
	switch {
	case err == nil && resp == nil:
		return "no response"
	case err == nil && idem.Replayed(resp):
		return statusLine(resp.StatusCode) + ", replayed"
	case err == nil:
		return statusLine(resp.StatusCode)
	case errors.Is(err, idem.ErrAttemptTimeout):
		return "attempt timed out"
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return "connection closed, no response"
	case errors.Is(err, syscall.ECONNRESET):
		return "connection reset, no response"
	case errors.Is(err, syscall.ECONNREFUSED):
		return "connection refused"
	}
	if ue := (*url.Error)(nil); errors.As(err, &ue) {
		// Without the method and URL, and with the first clause only:
		// "http2: server sent GOAWAY and closed the connection".
		msg, _, _ := strings.Cut(ue.Err.Error(), "; ")
		return msg
	}
	return err.Error()
}

// statusLine is a status code with its RFC 9110 reason phrase, as the
// runner prints it: "422 Unprocessable Content", whatever phrase the
// server sent.
func statusLine(code int) string {
	if phrase := httpstatus.Text(code); phrase != "" {
		return fmt.Sprintf("%d %s", code, phrase)
	}
	return fmt.Sprint(code)
}

type opKey struct{}

// withOp labels the client operations sent with ctx in the timeline.
func withOp(ctx context.Context, op string) context.Context {
	return context.WithValue(ctx, opKey{}, op)
}

func opFrom(ctx context.Context) string {
	if op, ok := ctx.Value(opKey{}).(string); ok {
		return op
	}
	return "pay"
}

// shortKey is the key as the timeline shows it: its first 8 characters.
func shortKey(key string) string {
	if key == "" {
		return "(no key)"
	}
	return key[:min(len(key), 8)]
}

// write prints the timeline, indented, in aligned columns: time, operation,
// attempt, key, outcome, what follows. Unless verbose, a run of attempts
// with the same outcome and the same next step is folded into one line.
func (tl *timeline) write(w *strings.Builder, verbose bool) {
	events := tl.snapshot()
	var rows [][]string
	for i := 0; i < len(events); i++ {
		e := events[i]
		at := fmt.Sprintf("%.3fs", e.at.Seconds())
		switch e.kind {
		case attemptEvent:
			last := i
			for !verbose && last+1 < len(events) && foldable(e, events[last+1]) {
				last++
			}
			n, out := fmt.Sprintf("#%d", e.n), e.outcome
			if last > i {
				n = fmt.Sprintf("#%d-%d", e.n, events[last].n)
				out = fmt.Sprintf("%s (x%d)", e.outcome, last-i+1)
			}
			rows = append(rows, []string{at, e.op, n, shortKey(e.key), out, events[last].next})
			i = last
		case faultEvent:
			rows = append(rows, []string{at, "fault", "", "", e.text})
		case serverEvent:
			rows = append(rows, []string{at, "server", "", "", e.text})
		case noteEvent:
			rows = append(rows, []string{at, "", "", "", e.text})
		}
	}
	writeTable(w, "    ", rows)
}

func foldable(a, b event) bool {
	return b.kind == attemptEvent && a.op == b.op && a.key == b.key && a.outcome == b.outcome && a.same == b.same
}

// writeTable writes rows in columns two spaces apart. The last cell of a
// row is not padded and does not widen its column, so a long note or the
// next step of an attempt never pushes the others apart.
func writeTable(w *strings.Builder, indent string, rows [][]string) {
	var widths []int
	for _, row := range rows {
		for i, cell := range row[:len(row)-1] {
			if i == len(widths) {
				widths = append(widths, 0)
			}
			widths[i] = max(widths[i], len(cell))
		}
	}
	for _, row := range rows {
		var line strings.Builder
		line.WriteString(indent)
		for i, cell := range row {
			if i == len(row)-1 {
				line.WriteString(cell)
				break
			}
			if i == 0 {
				fmt.Fprintf(&line, "%*s  ", widths[i], cell) // times align right
			} else {
				fmt.Fprintf(&line, "%-*s  ", widths[i], cell)
			}
		}
		w.WriteString(strings.TrimRight(line.String(), " "))
		w.WriteByte('\n')
	}
}

// logHandler is a slog.Handler that puts the server's warnings and errors
// on the timeline, for -v: an injected crash, a stuck key, a takeover.
type logHandler struct {
	tl    *timeline
	attrs []slog.Attr
}

func (h *logHandler) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelWarn }

func (h *logHandler) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	b.WriteString(r.Message)
	add := func(a slog.Attr) bool {
		switch a.Key {
		case "client", "method", "path", "key", "operation", "token":
			// Known from the timeline, or noise for a reader.
		default:
			fmt.Fprintf(&b, " %s=%v", a.Key, a.Value)
		}
		return true
	}
	for _, a := range h.attrs {
		add(a)
	}
	r.Attrs(add)
	h.tl.add(event{kind: serverEvent, text: b.String()})
	return nil
}

func (h *logHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return &logHandler{tl: h.tl, attrs: append(slices.Clip(h.attrs), attrs...)}
}

func (h *logHandler) WithGroup(string) slog.Handler { return h }
