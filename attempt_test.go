package idem

import (
	"context"
	"net/http"
	"net/http/httptrace"
	"strconv"
	"sync"
	"testing"
	"time"
	"unsafe"
)

// attemptLog is a base transport that records what AttemptFromContext
// says of each request it sends, and the key header it carries.
type attemptLog struct {
	base     http.RoundTripper
	mu       sync.Mutex
	attempts []Attempt
	keys     []string
}

func (l *attemptLog) RoundTrip(req *http.Request) (*http.Response, error) {
	a, ok := AttemptFromContext(req.Context())
	if !ok {
		a.Number = -1
	}
	l.mu.Lock()
	l.attempts = append(l.attempts, a)
	l.keys = append(l.keys, req.Header.Get(DefaultKeyHeader))
	l.mu.Unlock()
	return l.base.RoundTrip(req)
}

func TestAttemptFromContext(t *testing.T) {
	for _, tt := range []struct {
		name   string
		method string
		policy RetryPolicy
	}{
		{"keyed", http.MethodPost, fastPolicy},
		{"keyed with AttemptTimeout", http.MethodPost, RetryPolicy{InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond, AttemptTimeout: time.Minute}},
		{"unkeyed", http.MethodPut, fastPolicy},
	} {
		t.Run(tt.name, func(t *testing.T) {
			srv := newServer(t, &recorder{script: []int{503, 500, 201}})
			log := &attemptLog{base: newTransport(t, tt.policy).Base}
			tr := &Transport{Base: log, Retry: tt.policy}
			req, err := http.NewRequest(tt.method, srv.URL, nil)
			if err != nil {
				t.Fatal(err)
			}
			// Many header values, all sent with the key on every attempt.
			for i := range 10 {
				req.Header.Add("X-Many", strconv.Itoa(i))
			}
			resp, err := tr.RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			readAll(t, resp)
			if len(log.attempts) != 3 {
				t.Fatalf("base saw %d attempts, want 3", len(log.attempts))
			}
			for i, a := range log.attempts {
				if a.Number != i+1 || a.Key != log.keys[i] || (a.Key == "") == (tt.method == http.MethodPost) {
					t.Errorf("attempt %d: AttemptFromContext = %+v, key header %q; want number %d and the key sent", i+1, a, log.keys[i], i+1)
				}
			}
			if got := resp.Request.Header.Values("X-Many"); len(got) != 10 || got[9] != "9" {
				t.Errorf("X-Many sent as %q, want the 10 values", got)
			}
		})
	}
	if a, ok := AttemptFromContext(context.Background()); ok {
		t.Errorf("AttemptFromContext(Background) = %+v, true; want false", a)
	}
}

// TestWireTraceHooks: the hooks of an attempt's wire trace count on that
// attempt's trace and no other, made in place (as this toolchain lays out
// closures) or as closures, and a trace the caller put on the context
// still runs beside them.
func TestWireTraceHooks(t *testing.T) {
	if hooks.getConn == 0 || hooks.wroteHeaders == 0 {
		t.Error("the trace's hooks are closures: this toolchain's closures are not laid out as hook says")
	}
	inPlace := hooks
	for _, tt := range []struct {
		name  string
		hooks struct{ getConn, wroteHeaders uintptr }
	}{
		{"in place", inPlace},
		{"closures", struct{ getConn, wroteHeaders uintptr }{}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			hooks = tt.hooks
			defer func() { hooks = inPlace }()
			var callerConns, callerWrote int
			parent := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{
				GetConn:      func(string) { callerConns++ },
				WroteHeaders: func() { callerWrote++ },
			})
			var a, b attemptRequest
			a.traceWire(parent)
			b.traceWire(context.Background())
			trace := httptrace.ContextClientTrace(&a.ctx)
			if trace != &a.ctx.wire.trace {
				t.Fatal("the attempt's context does not hand its own trace to net/http")
			}
			trace.GetConn("api.example.com:443")
			trace.WroteHeaders()
			trace.WroteHeaders()
			if got := [2]int32{a.ctx.wire.conns.Load(), a.ctx.wire.wrote.Load()}; got != [2]int32{1, 2} {
				t.Errorf("GetConn and WroteHeaders counted %v on their attempt; want [1 2]", got)
			}
			if got := [2]int32{b.ctx.wire.conns.Load(), b.ctx.wire.wrote.Load()}; got != [2]int32{} {
				t.Errorf("another attempt's hooks counted %v on this one", got)
			}
			if callerConns != 1 || callerWrote != 2 {
				t.Errorf("the caller's hooks ran %d and %d times; want 1 and 2", callerConns, callerWrote)
			}
		})
	}
}

// TestAttemptSizeClass: an attempt's one allocation stays in the 576-byte
// size class on 64-bit platforms: an object with pointers over 512 bytes
// carries an 8-byte header, and the next class is 640 bytes.
func TestAttemptSizeClass(t *testing.T) {
	if unsafe.Sizeof(uintptr(0)) != 8 {
		t.Skip("sizes are for 64-bit platforms")
	}
	if size := unsafe.Sizeof(attemptRequest{}); size+8 > 576 {
		t.Errorf("attemptRequest is %d bytes; with its header it no longer fits the 576-byte size class", size)
	}
}
