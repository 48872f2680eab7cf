package idem

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// rawServer is an HTTP/1.1 server on 127.0.0.1 that writes its answers
// byte by byte, as no net/http server would: a malformed status line,
// headers over a limit, a connection cut after the request. Each request
// it reads whole (headers and body), records, and hands to answer with its
// number (1 for the first), whose bytes it writes as they are; an answer
// of "" closes the connection instead.
type rawServer struct {
	ln     net.Listener
	answer func(n int) string
	wg     sync.WaitGroup

	mu    sync.Mutex
	keys  []string // the Idempotency-Key of each request
	conns []net.Conn
}

func newRawServer(t *testing.T, answer func(n int) string) *rawServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	s := &rawServer{ln: ln, answer: answer}
	s.wg.Add(1)
	go s.accept()
	t.Cleanup(func() {
		ln.Close()
		s.mu.Lock()
		for _, c := range s.conns {
			c.Close()
		}
		s.mu.Unlock()
		s.wg.Wait()
	})
	return s
}

func (s *rawServer) URL() string { return "http://" + s.ln.Addr().String() }

func (s *rawServer) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.mu.Lock()
		s.conns = append(s.conns, c)
		s.mu.Unlock()
		s.wg.Add(1)
		go s.serve(c)
	}
}

func (s *rawServer) serve(c net.Conn) {
	defer s.wg.Done()
	defer c.Close()
	br := bufio.NewReader(c)
	for {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		_, _ = io.Copy(io.Discard, req.Body)
		s.mu.Lock()
		s.keys = append(s.keys, req.Header.Get(DefaultKeyHeader))
		n := len(s.keys)
		s.mu.Unlock()
		a := s.answer(n)
		if a == "" {
			return
		}
		if _, err := io.WriteString(c, a); err != nil {
			return
		}
	}
}

func (s *rawServer) seenKeys() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.keys...)
}

// rawCreated is a well-formed 201 answer.
const rawCreated = "HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 16\r\n\r\n{\"id\":\"pay_123\"}"

// TestUnreadableAnswerIsRetriedWithTheKey checks that a keyed POST whose
// answer net/http cannot read (the request was written, so the server may
// have acted on it) is retried with the same key, and ends, if every
// answer is unreadable, with a RetryError carrying the key.
func TestUnreadableAnswerIsRetriedWithTheKey(t *testing.T) {
	bigHeader := "HTTP/1.1 201 Created\r\nX-Padding: " + strings.Repeat("x", 4096) + "\r\nContent-Length: 0\r\n\r\n"
	for _, tt := range []struct {
		name, bad string
	}{
		{"malformed status code", "HTTP/1.1 2O1 Created\r\nContent-Length: 0\r\n\r\n"},
		{"malformed status line", "HTTP/1.1201Created\r\n\r\n"},
		{"not HTTP at all", "SSH-2.0-OpenSSH_9.6\r\n\r\n"},
		{"headers over MaxResponseHeaderBytes", bigHeader},
	} {
		t.Run(tt.name, func(t *testing.T) {
			newBase := func() *http.Transport {
				base := &http.Transport{MaxResponseHeaderBytes: 1024}
				t.Cleanup(base.CloseIdleConnections)
				return base
			}

			srv := newRawServer(t, func(n int) string {
				if n == 1 {
					return tt.bad
				}
				return rawCreated
			})
			tr := &Transport{Base: newBase(), Retry: fastPolicy}
			resp, err := post(t, tr, context.Background(), srv.URL(), `{"amount":4200}`)
			require.NoError(t, err, "the first answer was unreadable: want a retry with the same key")
			assert.Equal(t, http.StatusCreated, resp.StatusCode)
			assert.Equal(t, `{"id":"pay_123"}`, readAll(t, resp))
			keys := srv.seenKeys()
			require.Len(t, keys, 2)
			assert.NotEmpty(t, keys[0])
			assert.Equal(t, keys[0], keys[1], "the retry must send the same key")

			// Every answer unreadable: the key comes back with the error.
			always := newRawServer(t, func(int) string { return tt.bad })
			tr = &Transport{Base: newBase(), Retry: fastPolicy, DisableBudget: true}
			resp, err = post(t, tr, context.Background(), always.URL(), `{"amount":4200}`)
			require.Error(t, err)
			assert.Nil(t, resp)
			var rerr *RetryError
			require.ErrorAs(t, err, &rerr)
			keys = always.seenKeys()
			require.Len(t, keys, DefaultMaxAttempts)
			assert.Equal(t, keys[0], rerr.Key)
			assert.Equal(t, DefaultMaxAttempts, rerr.Attempts)
		})
	}
}

// killableConn is a client connection that a test can make read EOF, as
// if the server had closed it, and that says when net/http closes it.
type killableConn struct {
	net.Conn
	killed atomic.Bool
	closed chan struct{}
	once   sync.Once
}

func (c *killableConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if c.killed.Load() {
		return 0, io.EOF
	}
	return n, err
}

func (c *killableConn) Close() error {
	c.once.Do(func() { close(c.closed) })
	return c.Conn.Close()
}

// kill makes the connection's pending and future reads return EOF, and
// waits until net/http has closed it.
func (c *killableConn) kill() {
	c.killed.Store(true)
	c.Conn.SetReadDeadline(time.Now()) // wake the read loop's Peek
	<-c.closed
}

// TestServerClosedIdleIsRetried checks the race of a keep-alive
// connection that the server closes just as a request is handed to it:
// net/http then returns "http: server closed idle connection", and
// re-sends the request itself only if it looks replayable (an
// Idempotency-Key header). A key in another header, PayPal's, gets no
// such replay, and the Transport retries it, with the same key.
func TestServerClosedIdleIsRetried(t *testing.T) {
	var mu sync.Mutex
	var keys []string
	srv := newServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			mu.Lock()
			keys = append(keys, r.Header.Get("PayPal-Request-Id"))
			mu.Unlock()
		}
		w.WriteHeader(http.StatusCreated)
	}))
	// The race is made, not waited for: a GotConn hook kills the idle
	// connection just handed to the request, before net/http counts the
	// request as sent on it. The hook returns once net/http has closed the
	// connection; net/http marks it closed a moment later, and only then
	// does the request fail with the error sought. Tries that lose that
	// moment fail otherwise (and are retried by net/http itself), so the
	// scenario runs until one gets the error.
	for try := 1; try <= 50; try++ {
		var conns []*killableConn
		base := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			kc := &killableConn{Conn: c, closed: make(chan struct{})}
			conns = append(conns, kc)
			return kc, nil
		}}
		// Warm up: one connection, idle in the pool.
		resp, err := base.RoundTrip(httptest.NewRequest(http.MethodGet, srv.URL, nil).WithContext(context.Background()))
		require.NoError(t, err)
		resp.Body.Close()
		require.Len(t, conns, 1)

		trace := &httptrace.ClientTrace{GotConn: func(info httptrace.GotConnInfo) {
			if info.Reused {
				conns[0].kill()
			}
		}}
		ctx := httptrace.WithClientTrace(context.Background(), trace)
		var first error
		tr := &Transport{Base: base, KeyHeader: "PayPal-Request-Id", Retry: fastPolicy, OnAttempt: func(a Attempt) {
			if a.Number == 1 {
				first = a.Err
			}
		}}
		mu.Lock()
		keys = nil
		mu.Unlock()
		resp, err = post(t, tr, ctx, srv.URL+"/v1/orders", `{"amount":4200}`)
		base.CloseIdleConnections()
		if first == nil || first.Error() != "http: server closed idle connection" {
			t.Logf("try %d: the first attempt ended with %v, not the race sought", try, first)
			if resp != nil {
				resp.Body.Close()
			}
			continue
		}
		require.NoError(t, err, "the first attempt failed with %v: want it retried", first)
		assert.Equal(t, http.StatusCreated, resp.StatusCode)
		resp.Body.Close()
		mu.Lock()
		defer mu.Unlock()
		require.Len(t, keys, 1, "the first attempt never reached the server")
		assert.NotEmpty(t, keys[0])
		return
	}
	t.Fatal("the race was never won")
}
