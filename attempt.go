package idem

import (
	"context"
	"net/http"
	"net/http/httptrace"
	"reflect"
	"sync/atomic"
)

// attemptContext is the context of one attempt's request: the operation's
// context (or the attempt's own cancelable one), carrying the attempt's
// number and key for AttemptFromContext. It also holds the slice element
// that backs the key header's value in the attempt's header copy.
type attemptContext struct {
	context.Context
	number   int
	key      string
	keyValue [1]string
	trace    *httptrace.ClientTrace // the attempt's wire trace, for net/http
	// afterReached says an earlier attempt of the operation may have
	// reached the server: this one's answer is no word on that one's.
	afterReached bool
}

// attemptRequest is an attempt's request and its context in one
// allocation: WithContext's copy, inlined, stays on the stack and is copied
// here, its context field included.
type attemptRequest struct {
	req    http.Request
	ctx    attemptContext
	answer answerBody   // the body of a 2xx answer read inside the attempt
	wire   wireTrace    // what net/http put on the wire for the attempt
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
}

// traceWire sets up the attempt's wire trace, which its context hands to
// net/http. The trace rides in the attempt's own allocation (which it
// moves from the 384-byte size class to the 576-byte one); its two hooks
// are the only allocations it adds. A trace the caller put on the
// request's context (parent) is composed into it, so its hooks still run.
func (ar *attemptRequest) traceWire(parent context.Context) {
	w := &ar.wire
	w.trace.GetConn = func(string) { w.conns.Add(1) }
	w.trace.WroteHeaders = func() { w.wrote.Add(1) }
	if httptrace.ContextClientTrace(parent) != nil {
		// WithClientTrace composes the caller's hooks into w.trace; the
		// context it returns is not needed, as the attempt's context
		// answers for the trace itself.
		_ = httptrace.WithClientTrace(parent, &w.trace)
	}
	ar.ctx.trace = &w.trace
}

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

// traceKeyType is the type of traceKey if it has no size, as context keys
// usually have (httptrace's is a struct{}): every value of it is traceKey
// then, and comparing types is enough, where comparing two interfaces of
// one type calls its equality function. Else it is nil.
var traceKeyType = func() reflect.Type {
	if t := reflect.TypeOf(traceKey); t != nil && t.Size() == 0 {
		return t
	}
	return nil
}()

// isTraceKey reports whether key is traceKey.
func isTraceKey(key any) bool {
	if traceKeyType != nil {
		return reflect.TypeOf(key) == traceKeyType
	}
	return key == traceKey
}

type attemptContextKey struct{}

// Value returns the context itself for attemptContextKey, so that a lookup
// allocates nothing, and defers to the parent for any other key. (Keys are
// told by their type: key == attemptContextKey{} would call the type's
// equality function.)
func (c *attemptContext) Value(key any) any {
	if _, ok := key.(attemptContextKey); ok {
		return c
	}
	if c.trace != nil && isTraceKey(key) {
		return c.trace
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
