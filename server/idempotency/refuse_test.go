package idempotency

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestRefusedBeforeTheBodyClosesTheConnection sends requests that claim a
// large body, send one byte of it and stall: those the middleware refuses
// before it reads the body (no client, no key, a bad key) are answered at
// once and their connection is closed, instead of waiting for a body that
// never comes while net/http drains it.
func TestRefusedBeforeTheBodyClosesTheConnection(t *testing.T) {
	h := Middleware(NewMemoryStore(), Options{
		Logger: testLogger(t),
		ClientID: func(r *http.Request) (string, bool) {
			c := r.Header.Get("X-Client")
			return c, c != ""
		},
	})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t.Error("the handler ran")
	}))
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	for _, tc := range []struct {
		name, headers string
		status        int
	}{
		{"no client", "Idempotency-Key: k1\r\n", http.StatusUnauthorized},
		{"no key", "X-Client: a\r\n", http.StatusBadRequest},
		{"bad key", "X-Client: a\r\nIdempotency-Key: \"unterminated\r\n", http.StatusBadRequest},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conn, err := net.Dial("tcp", srv.Listener.Addr().String())
			require.NoError(t, err)
			defer conn.Close()
			require.NoError(t, conn.SetDeadline(time.Now().Add(10*time.Second))) // a hang fails, not blocks
			_, err = io.WriteString(conn, "POST /v1/payments HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"+
				tc.headers+"Content-Length: 100000\r\n\r\n{")
			require.NoError(t, err)
			br := bufio.NewReader(conn)
			resp, err := http.ReadResponse(br, nil)
			require.NoError(t, err, "no answer before the body")
			assert.Equal(t, tc.status, resp.StatusCode)
			assert.True(t, resp.Close, "Connection: close")
			_, err = io.Copy(io.Discard, resp.Body)
			require.NoError(t, err)
			_, err = br.ReadByte()
			assert.ErrorIs(t, err, io.EOF, "the server closes the connection")
		})
	}
	// A refused request without a body keeps its connection.
	resp, err := http.Post(srv.URL, "application/json", strings.NewReader(""))
	require.NoError(t, err)
	resp.Body.Close()
	assert.False(t, resp.Close)
}
