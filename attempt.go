package idem

import (
	"context"
	"net/http"
	"net/http/httptrace"
	"reflect"
	"sync"
	"sync/atomic"
)

// attemptContext is the context of one attempt's request: the operation's
// context (or the attempt's own cancelable one), carrying the attempt's
// number and key for AttemptFromContext, and its wire trace for net/http.
// It also holds the slice element that backs the key header's value in
// the attempt's header copy.
type attemptContext struct {
	context.Context
	key      string
	keyValue [1]string
	// kit holds the attempt's wire trace, which the context hands to
	// net/http until flagUntraced says the attempt is done with it.
	// (Set before the context is shared, kit needs no atomic of its own.)
	kit *kit
	// number is the attempt's number; an int32 (no operation waits
	// through 2^31 backoffs), so that with flags the attempt's object fits
	// the 384-byte size class (an int would take it to the 416-byte one).
	number int32
	flags  atomic.Uint32 // untraced and afterReached
}

// The flags of an attemptContext.
const (
	// flagUntraced says the attempt is done with its kit's trace: the context
	// hands net/http the caller's trace, if any, from then on.
	flagUntraced = 1 << iota
	// flagAfterReached says an earlier attempt of the operation may have
	// reached the server: this one's answer is no word on that one's.
	// Set before the context is shared, never changed.
	flagAfterReached
)

// attemptRequest is an attempt's request and its context in one
// allocation: WithContext's copy, inlined, stays on the stack and is copied
// here, its context field included. On a 64-bit platform it is 384 bytes
// with Go 1.26's http.Request, a size class: a field more takes it to the
// next (TestAttemptFitsItsSizeClass).
type attemptRequest struct {
	req    http.Request
	ctx    attemptContext
	answer answerState // of a 2xx answer read inside the attempt (answer.go)
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

// A kit is what an attempt borrows for as long as the Base may use its
// request: its wire trace, whose hooks are two closures over it (two
// allocations, made once per kit), and the buffer of its answer, if one is
// read inside the attempt. An attempt gives its kit back once it has
// closed its answer itself (read whole, or drained before a retry): by the
// RoundTripper contract, the Base is then done with the request and with
// its hooks. An answer read whole holds the kit until the caller closes
// it. A kit goes back to its Transport's spare slot, where the next
// attempt finds it (one kit, and a buffer of at most 64 KiB, for as long
// as the Transport lives), or, if that is taken, to the kits pool.
// (net/http's HTTP/1 writer may still report headers written after an
// early answer: counted on another attempt, that can only make it "may
// have reached", never "not sent".) Any other attempt (unkeyed, its answer
// handed over unread, an error) leaves its kit to the garbage collector,
// and a kit that carries the caller's hooks too is never used again.
type kit struct {
	wire     wireTrace
	buf      *answerBuf           // kept from the last answer it held (answer.go)
	spare    *atomic.Pointer[kit] // its Transport's spare, where it goes back first
	composed bool                 // wire calls the caller's hooks too
}

// kits holds the kits that attempts gave back.
var kits sync.Pool

// newKit returns a kit with its wire trace's hooks.
func newKit() *kit {
	k := new(kit)
	w := &k.wire
	w.trace.GetConn = func(string) { w.conns.Add(1) }
	w.trace.WroteHeaders = func() { w.wrote.Add(1) }
	return k
}

// borrowKit gives the attempt a kit, whose wire trace its context hands
// to net/http: one given back by an earlier attempt, if any. A trace the
// caller put on the request's context (parent) is composed into a new
// kit's, so its hooks still run.
func (ar *attemptRequest) borrowKit(parent context.Context, spare *atomic.Pointer[kit]) *kit {
	var k *kit
	if httptrace.ContextClientTrace(parent) != nil {
		k = newKit()
		k.composed = true
		// WithClientTrace composes the caller's hooks into the trace; the
		// context it returns is not needed, as the attempt's context
		// answers for the trace itself.
		_ = httptrace.WithClientTrace(parent, &k.wire.trace)
	} else if k = spare.Swap(nil); k == nil {
		if k, _ = kits.Get().(*kit); k == nil {
			k = newKit()
		}
	}
	k.wire.conns.Store(0)
	k.wire.wrote.Store(0)
	k.spare = spare
	ar.ctx.kit = k
	return k
}

// untrace takes the attempt's wire trace from its context, which then
// hands net/http the caller's trace, if any, and returns its kit the first
// time, nil after.
func (ar *attemptRequest) untrace() *kit {
	if ar.ctx.flags.Or(flagUntraced)&flagUntraced != 0 {
		return nil
	}
	return ar.ctx.kit
}

// giveBack returns k for another attempt to borrow. Nothing may use it,
// nor the buffer it holds, after that.
func (k *kit) giveBack() {
	if k.composed {
		k.dropBuf()
		return
	}
	if k.buf != nil && !pooledClass(k.buf) {
		k.buf = nil // one of its own: left to the garbage collector
	}
	if k.spare == nil || !k.spare.CompareAndSwap(nil, k) {
		kits.Put(k)
	}
}

// dropBuf gives the buffer k holds back to its pool, for a kit that is
// left to the garbage collector.
func (k *kit) dropBuf() {
	if k.buf != nil {
		putAnswerBuf(k.buf)
		k.buf = nil
	}
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
	if isTraceKey(key) {
		if c.flags.Load()&flagUntraced == 0 {
			return &c.kit.wire.trace
		}
	}
	return c.Context.Value(key)
}

// isAttempt reports whether ctx is c or carries it: the context of a
// request a Base made of the attempt's (net/http makes one, its context
// the attempt's, for every request with a body).
func isAttempt(ctx context.Context, c *attemptContext) bool {
	return ctx == context.Context(c) || ctx.Value(attemptContextKey{}) == c
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
	return Attempt{Number: int(c.number), Key: c.key}, true
}
