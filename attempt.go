package idem

import (
	"context"
	"net/http"
	"net/http/httptrace"
	"sync/atomic"
	"unsafe"
)

// attemptContext is the context of one attempt's request: the operation's
// context (or the attempt's own cancelable one), carrying the attempt's
// number and key for AttemptFromContext, and the attempt's wire trace for
// net/http. It also holds the slice element that backs the key header's
// value in the attempt's header copy.
type attemptContext struct {
	context.Context
	number   int
	key      string
	keyValue [1]string
	wire     wireTrace // what net/http put on the wire for the attempt
	// afterReached says an earlier attempt of the operation may have
	// reached the server: this one's answer is no word on that one's.
	afterReached bool
}

// attemptRequest is an attempt's request and its context in one
// allocation of 568 bytes (the 576-byte size class, with the header of an
// object with pointers over 512 bytes; TestAttemptSizeClass): WithContext's
// copy, inlined, stays on the stack and is copied here, its context field
// included.
type attemptRequest struct {
	req    http.Request
	ctx    attemptContext
	answer answerBody   // the body of a 2xx answer read inside the attempt
	body   *trackedBody // the request body, if it is not read from memory
}

// wireTrace learns from net/http, through its httptrace hooks, whether an
// attempt's request may have reached the server: net/http calls GetConn
// before it looks for a connection, and WroteHeaders once a try's headers
// are written, before they are flushed; a server can act on a request
// only once it has its headers. Each is counted over every try net/http
// makes of the attempt, its own re-sends on a new connection included.
// The hooks run on net/http's goroutines, hence the atomics.
type wireTrace struct {
	trace httptrace.ClientTrace
	conns atomic.Int32 // GetConn calls: the Base honours httptrace
	wrote atomic.Int32 // WroteHeaders calls
	// The closures of trace's two hooks, made in place (see hook).
	getConn, wroteHeaders hook
}

// traceWire sets up the attempt's wire trace, which its context hands to
// net/http. The trace and its hooks ride in the attempt's own allocation:
// they allocate nothing. A trace the caller put on the request's context
// (parent) is composed into it, so its hooks still run.
func (ar *attemptRequest) traceWire(parent context.Context) {
	w := &ar.ctx.wire
	if hooks.getConn != 0 {
		w.getConn = hook{code: hooks.getConn, w: w}
		w.wroteHeaders = hook{code: hooks.wroteHeaders, w: w}
		w.trace.GetConn = hookFunc[func(string)](&w.getConn)
		w.trace.WroteHeaders = hookFunc[func()](&w.wroteHeaders)
	} else {
		w.trace.GetConn = getConnHook(w)
		w.trace.WroteHeaders = wroteHeadersHook(w)
	}
	if httptrace.ContextClientTrace(parent) != nil {
		// WithClientTrace composes the caller's hooks into w.trace; the
		// context it returns is not needed, as the attempt's context
		// answers for the trace itself.
		_ = httptrace.WithClientTrace(parent, &w.trace)
	}
}

// getConnHook and wroteHeadersHook return the hooks of w's trace as
// closures, two allocations of 16 bytes per attempt, which were half of
// what a first try allocated beyond a bare transport's and cost some 540
// instructions. traceWire makes the same closures in place, in w itself
// (see hook), when this toolchain's closures are laid out as hook is.
func getConnHook(w *wireTrace) func(string) { return func(string) { w.conns.Add(1) } }
func wroteHeadersHook(w *wireTrace) func()  { return func() { w.wrote.Add(1) } }

// hook is the memory of a closure of getConnHook or wroteHeadersHook:
// the address of its code, then the one variable it captures, w. A Go
// func value is a pointer to such memory; the code finds what it captured
// after its own address. The gc toolchain lays out a closure this way
// (cmd/compile's closure conversion, the "Go 1.1 Function Calls" design),
// and hooks checks it on the real thing when the package starts, so that
// another layout falls back to real closures rather than to wrong code.
type hook struct {
	code uintptr
	w    *wireTrace
}

// hookFunc returns the func value of the closure h: a pointer to it.
func hookFunc[F func(string) | func()](h *hook) F {
	return *(*F)(unsafe.Pointer(&h))
}

// hooks holds the addresses of the code of the two hooks' closures, or
// zeros if their closures are not laid out as hook says.
var hooks = func() (code struct{ getConn, wroteHeaders uintptr }) {
	probe := new(wireTrace)
	g, h := getConnHook(probe), wroteHeadersHook(probe)
	gm, hm := *(**hook)(unsafe.Pointer(&g)), *(**hook)(unsafe.Pointer(&h))
	if gm.w != probe || hm.w != probe || gm.code == 0 || hm.code == 0 {
		return code
	}
	// The closures in place must count on their own wireTrace, and only
	// there.
	var w wireTrace
	w.getConn, w.wroteHeaders = hook{gm.code, &w}, hook{hm.code, &w}
	hookFunc[func(string)](&w.getConn)("probe:80")
	hookFunc[func()](&w.wroteHeaders)()
	if w.conns.Load() != 1 || w.wrote.Load() != 1 || probe.conns.Load() != 0 || probe.wrote.Load() != 0 {
		return code
	}
	code.getConn, code.wroteHeaders = gm.code, hm.code
	return code
}()

// traceKey is the key under which httptrace looks a ClientTrace up in a
// context, learnt once by asking a context that records it: the
// attempt's context answers it without a context.WithValue of its own.
var traceKey = func() any {
	var p keyProbe
	httptrace.ContextClientTrace(&p)
	return p.key
}()

// keyProbe is a context that records the key it is asked for.
type keyProbe struct {
	context.Context
	key any
}

func (p *keyProbe) Value(key any) any {
	p.key = key
	return nil
}

type attemptContextKey struct{}

// Value returns the context itself for attemptContextKey, so that a lookup
// allocates nothing, and defers to the parent for any other key.
func (c *attemptContext) Value(key any) any {
	if key == (attemptContextKey{}) {
		return c
	}
	if key == traceKey {
		return &c.wire.trace
	}
	return c.Context.Value(key)
}

// AttemptFromContext returns the attempt carried by a request's context
// inside [Transport.Base]: the attempt's Number and the operation's Key ("" when
// the method is not keyed). A base transport that traces, signs or logs
// requests uses it to tell the attempts of one operation apart. It reports
// false for a context that did not come from a Transport's attempt.
func AttemptFromContext(ctx context.Context) (Attempt, bool) {
	c, ok := ctx.Value(attemptContextKey{}).(*attemptContext)
	if !ok {
		return Attempt{}, false
	}
	return Attempt{Number: c.number, Key: c.key}, true
}
