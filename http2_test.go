package idem

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// newHTTP2Server starts an httptest TLS server that speaks HTTP/2.
func newHTTP2Server(t *testing.T, h http.Handler) *httptest.Server {
	t.Helper()
	srv := httptest.NewUnstartedServer(h)
	srv.EnableHTTP2 = true
	srv.Config.ErrorLog = discardLog() // aborted handlers are logged
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return srv
}

// routed is a base transport that sends the first attempt to first and
// every later one to rest, both HTTP/2 test servers, and records the
// first attempt's error and the key of every attempt.
type routed struct {
	first, rest *httptest.Server
	mu          sync.Mutex
	firstErr    error
	keys        []string
}

func (r *routed) RoundTrip(req *http.Request) (*http.Response, error) {
	a, _ := AttemptFromContext(req.Context())
	r.mu.Lock()
	r.keys = append(r.keys, req.Header.Get(DefaultKeyHeader))
	r.mu.Unlock()
	srv := r.rest
	if a.Number == 1 {
		srv = r.first
	}
	req = req.Clone(req.Context())
	req.URL.Host, req.Host = srv.Listener.Addr().String(), ""
	resp, err := srv.Client().Transport.RoundTrip(req)
	if a.Number == 1 {
		r.mu.Lock()
		r.firstErr = err
		r.mu.Unlock()
	}
	return resp, err
}

// created answers 201 with the request's body.
var created = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	w.WriteHeader(http.StatusCreated)
	w.Write(body)
})

// sendHTTP2 posts a body through a Transport over rt and checks that it
// ends in the 201 of the second attempt, with one key on both attempts.
func sendHTTP2(t *testing.T, rt *routed) {
	t.Helper()
	resp, err := post(t, &Transport{Base: rt, Retry: fastPolicy}, context.Background(), "https://idem.invalid/v1/payments", `{"amount":4200}`)
	if err != nil {
		t.Fatalf("err = %v, want the fault retried (the first attempt failed with %v)", err, rt.firstErr)
	}
	if body := readAll(t, resp); resp.StatusCode != http.StatusCreated || body != `{"amount":4200}` || resp.ProtoMajor != 2 {
		t.Errorf("got %s %s %q, want HTTP/2 201 with the body sent again", resp.Proto, resp.Status, body)
	}
	if len(rt.keys) != 2 || rt.keys[0] == "" || rt.keys[0] != rt.keys[1] {
		t.Errorf("keys %q, want the same key on the two attempts", rt.keys)
	}
}

func TestHTTP2FaultsAreRetried(t *testing.T) {
	t.Run("RST_STREAM before the response", func(t *testing.T) {
		aborting := newHTTP2Server(t, http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
			panic(http.ErrAbortHandler) // the server resets the stream
		}))
		rt := &routed{first: aborting, rest: newHTTP2Server(t, created)}
		sendHTTP2(t, rt)
		if got := http2Reason(rt.firstErr); got != "HTTP/2 stream reset" {
			t.Errorf("the first attempt failed with %v (%T), classified %q; want a stream reset", rt.firstErr, rt.firstErr, got)
		}
	})

	t.Run("GOAWAY and close", func(t *testing.T) {
		// A server shutting down sends GOAWAY, then closes the connection
		// with the request still running. Another goroutine of the server
		// sends the GOAWAY: the scenario runs again, with a longer pause
		// before the close, until the client saw the GOAWAY first (else
		// its error is a plain unexpected EOF, retried as such).
		for try := 1; try <= 20; try++ {
			running, release := make(chan struct{}), make(chan struct{})
			closing := newHTTP2Server(t, http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
				close(running)
				<-release
			}))
			go func() {
				<-running
				go closing.Config.Shutdown(context.Background())
				time.Sleep(time.Duration(try) * 10 * time.Millisecond)
				closing.CloseClientConnections()
				close(release)
			}()
			rt := &routed{first: closing, rest: newHTTP2Server(t, created)}
			sendHTTP2(t, rt)
			if got := http2Reason(rt.firstErr); got == "HTTP/2 GOAWAY" {
				return
			}
			t.Logf("try %d: the first attempt failed with %v, not a GOAWAY", try, rt.firstErr)
		}
		t.Fatal("the client never saw the GOAWAY before the close")
	})

	t.Run("reset after the response headers", func(t *testing.T) {
		var calls atomic.Int32
		srv := newHTTP2Server(t, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			calls.Add(1)
			w.WriteHeader(http.StatusCreated)
			w.(http.Flusher).Flush()
			panic(http.ErrAbortHandler)
		}))
		tr := &Transport{Base: srv.Client().Transport, Retry: fastPolicy}
		resp, err := post(t, tr, context.Background(), srv.URL, `{"amount":4200}`)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if _, err := io.ReadAll(resp.Body); err == nil || http2Reason(err) != "HTTP/2 stream reset" || resp.StatusCode != http.StatusCreated || calls.Load() != 1 {
			t.Errorf("status %d, body error %v after %d requests; want the 201 once, its body read failing with the reset", resp.StatusCode, err, calls.Load())
		}
	})
}

// freezer is a TCP proxy on 127.0.0.1 whose connections can be frozen:
// from then on it forwards nothing either way, but keeps reading, so each
// peer sees a live connection that has gone silent. Connections opened
// after a freeze are forwarded as usual.
type freezer struct {
	ln     net.Listener
	target string
	wg     sync.WaitGroup

	mu    sync.Mutex
	conns []*frozenPair
}

type frozenPair struct {
	client, server net.Conn
	frozen         atomic.Bool
}

func newFreezer(t *testing.T, target string) *freezer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	f := &freezer{ln: ln, target: target}
	f.wg.Add(1)
	go f.accept()
	t.Cleanup(func() {
		ln.Close()
		f.mu.Lock()
		for _, p := range f.conns {
			p.client.Close()
			p.server.Close()
		}
		f.mu.Unlock()
		f.wg.Wait()
	})
	return f
}

func (f *freezer) accept() {
	defer f.wg.Done()
	for {
		c, err := f.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", f.target)
		if err != nil {
			c.Close()
			continue
		}
		p := &frozenPair{client: c, server: s}
		f.mu.Lock()
		f.conns = append(f.conns, p)
		f.mu.Unlock()
		f.wg.Add(2)
		go f.pipe(p, c, s)
		go f.pipe(p, s, c)
	}
}

// pipe copies from src to dst until either closes, dropping what it reads
// once the pair is frozen.
func (f *freezer) pipe(p *frozenPair, src, dst net.Conn) {
	defer f.wg.Done()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && !p.frozen.Load() {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// freeze silences every connection open now.
func (f *freezer) freeze() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, p := range f.conns {
		p.frozen.Store(true)
	}
}

// TestHTTP2LostConnectionIsRetried checks that an HTTP/2 connection whose
// peer received the whole request and went silent, which the base
// transport's ping health check ends with "http2: client connection
// lost", is retried like any connection broken before a response: with
// the same key, on a new connection.
func TestHTTP2LostConnectionIsRetried(t *testing.T) {
	var px *freezer
	var mu sync.Mutex
	var keys []string
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		keys = append(keys, r.Header.Get(DefaultKeyHeader))
		n := len(keys)
		mu.Unlock()
		if n == 1 {
			px.freeze() // the request is in; its answer, and every ping's, is lost
		}
		w.WriteHeader(http.StatusCreated)
		w.Write(body)
	}))
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Config.ErrorLog = discardLog()
	srv.Start()
	t.Cleanup(srv.Close)
	px = newFreezer(t, srv.Listener.Addr().String())

	base := &http.Transport{
		Protocols: new(http.Protocols),
		HTTP2:     &http.HTTP2Config{SendPingTimeout: 50 * time.Millisecond, PingTimeout: 50 * time.Millisecond},
	}
	base.Protocols.SetUnencryptedHTTP2(true)
	t.Cleanup(base.CloseIdleConnections)
	var first error
	tr := &Transport{Base: base, Retry: fastPolicy, OnAttempt: func(a Attempt) {
		if a.Number == 1 {
			first = a.Err
		}
	}}
	resp, err := post(t, tr, context.Background(), "http://"+px.ln.Addr().String()+"/v1/payments", `{"amount":4200}`)
	require.NoError(t, err, "the first attempt failed with %v", first)
	assert.Equal(t, http.StatusCreated, resp.StatusCode)
	assert.Equal(t, 2, resp.ProtoMajor)
	assert.Equal(t, `{"amount":4200}`, readAll(t, resp))
	require.Error(t, first)
	assert.Contains(t, first.Error(), "client connection lost", "the first attempt should have died of unanswered pings")
	mu.Lock()
	defer mu.Unlock()
	// Two attempts, or more: a busy machine may answer a ping of the
	// healthy retry's connection late too.
	require.GreaterOrEqual(t, len(keys), 2)
	assert.NotEmpty(t, keys[0])
	for _, k := range keys[1:] {
		assert.Equal(t, keys[0], k, "every retry must send the same key")
	}
}
