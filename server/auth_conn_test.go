package server

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestUnauthorizedNotDrained sends requests that fail authentication and
// announce a 100 000-byte body of which they send one byte, on a real
// listener: each is answered 401 at once, with Connection: close, and the
// connection is then closed (EOF), without the server waiting for the rest
// of the body. Before, net/http drained the body before writing the 401
// (it discards up to 256 KiB so the connection can be reused), so such a
// client was never answered and held its connection.
func TestUnauthorizedNotDrained(t *testing.T) {
	ts := newTestServer(t, memoryStorage(t), Config{})
	addr := strings.TrimPrefix(ts.URL, "http://")
	for _, tt := range []struct {
		name string
		auth []string // Authorization lines
	}{
		{"no token", nil},
		{"unknown token", []string{"Bearer sk_nope"}},
		{"two lines", []string{"Bearer " + tokenA, "Bearer " + tokenA}},
		{"two lines, one unknown", []string{"Bearer " + tokenA, "Bearer sk_nope"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			conn, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			// Generous: only so that a regression fails instead of hanging.
			conn.SetDeadline(time.Now().Add(10 * time.Second))
			var req strings.Builder
			req.WriteString("POST /v1/payments HTTP/1.1\r\nHost: idem\r\nIdempotency-Key: k-slow\r\n")
			for _, a := range tt.auth {
				fmt.Fprintf(&req, "Authorization: %s\r\n", a)
			}
			req.WriteString("Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
			if _, err := io.WriteString(conn, req.String()); err != nil {
				t.Fatal(err)
			}
			br := bufio.NewReader(conn)
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("no answer to an unauthenticated request whose body stalls: %v", err)
			}
			body, err := io.ReadAll(resp.Body)
			if err != nil || resp.StatusCode != http.StatusUnauthorized || !resp.Close {
				t.Errorf("%d Connection: %q %s %v; want 401 with Connection: close", resp.StatusCode, resp.Header.Get("Connection"), body, err)
			}
			if _, err := br.ReadByte(); err != io.EOF {
				t.Errorf("after the 401: %v, want EOF: the server closes the connection", err)
			}
		})
	}
	if n := ts.charges.created.Load(); n != 0 {
		t.Errorf("%d charges", n)
	}
}

// TestAuthorizedKeepsConnection checks that a request that passes
// authentication keeps its connection for the next one.
func TestAuthorizedKeepsConnection(t *testing.T) {
	ts := newTestServer(t, memoryStorage(t), Config{})
	conns := 0
	tr := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		conns++
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}}
	defer tr.CloseIdleConnections()
	ts.client = &http.Client{Transport: tr}
	for i := range 3 {
		if r := ts.mustSend(t, keyed(fmt.Sprint("k-keep-", i), payment)); r.status != http.StatusCreated {
			t.Fatalf("%d %s", r.status, r.body)
		}
	}
	if conns != 1 {
		t.Errorf("%d connections dialled for three authorized requests, want 1", conns)
	}
}
