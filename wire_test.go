package idem

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"

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
