package idem

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestOutcomeUnknownWhenHeadersReachedAndResendRefused: a POST with
// Expect: 100-continue on a pooled keep-alive connection; the server reads
// its headers and key, acts on them without reading the body, and cuts the
// connection; net/http re-sends the request on a new connection, which is
// refused. The body was never read, yet the server recorded the request:
// the outcome is unknown, not "not sent".
func TestOutcomeUnknownWhenHeadersReachedAndResendRefused(t *testing.T) {
	recorded := make(chan string, 2)
	var srv *httptest.Server
	srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet {
			return // the warm-up: leaves a keep-alive connection in the pool
		}
		recorded <- r.Header.Get(DefaultKeyHeader)
		srv.Listener.Close() // net/http's re-send is refused
		conn, _, err := w.(http.Hijacker).Hijack()
		if err == nil {
			conn.Close()
		}
	}))
	defer srv.Close()
	base := &http.Transport{ExpectContinueTimeout: time.Minute}
	defer base.CloseIdleConnections()

	warm, err := http.NewRequest(http.MethodGet, srv.URL, nil)
	require.NoError(t, err)
	resp, err := base.RoundTrip(warm)
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()

	var reused atomic.Bool
	ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{
		GotConn: func(i httptrace.GotConnInfo) { reused.Store(reused.Load() || i.Reused) },
	})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader(`{"amount":4200}`))
	require.NoError(t, err)
	req.Header.Set("Expect", "100-continue")
	tr := &Transport{Base: base, Retry: RetryPolicy{MaxAttempts: 1}}
	resp, err = tr.RoundTrip(req)
	require.Error(t, err)
	require.True(t, reused.Load(), "the POST went out on the pooled connection (the caller's trace still runs)")
	assert.NotEmpty(t, <-recorded, "the server recorded the request")
	assert.Equal(t, OutcomeUnknown, OutcomeOf(resp, err), "err: %v", err)
}

// TestOutcomeUnknownWhenHTTP2ResendAfterProtocolErrorIsRefused: the
// server resets an HTTP/2 stream with PROTOCOL_ERROR once it has its
// headers, and goes away; net/http re-sends such a request by itself
// (golang/go#47635), on a new connection, which is refused. The server had
// the headers and the key: the outcome is unknown.
func TestOutcomeUnknownWhenHTTP2ResendAfterProtocolErrorIsRefused(t *testing.T) {
	var headers atomic.Int32
	srv := httptest.NewUnstartedServer(nil)
	srv.EnableHTTP2 = true
	srv.Config.ErrorLog = discardLog()
	srv.Config.TLSNextProto = map[string]func(*http.Server, *tls.Conn, http.Handler){
		"h2": func(_ *http.Server, c *tls.Conn, _ http.Handler) {
			defer c.Close()
			if _, err := io.ReadFull(c, make([]byte, len("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"))); err != nil {
				return
			}
			writeFrame(c, 0x4, 0, 0, nil) // SETTINGS
			for {
				typ, flags, stream, err := readFrame(c)
				switch {
				case err != nil:
					return
				case typ == 0x4 && flags&0x1 == 0: // SETTINGS: ACK it
					writeFrame(c, 0x4, 0x1, 0, nil)
				case typ == 0x1: // HEADERS: the request, key included
					headers.Add(1)
					srv.Listener.Close()                                // net/http's re-send is refused
					writeFrame(c, 0x3, 0, stream, []byte{0, 0, 0, 0x1}) // RST_STREAM PROTOCOL_ERROR
					return
				}
			}
		},
	}
	srv.StartTLS()
	defer srv.Close()
	base := srv.Client().Transport.(*http.Transport).Clone()
	base.ExpectContinueTimeout = time.Minute // the body waits for the server
	defer base.CloseIdleConnections()

	req, err := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{"amount":4200}`))
	require.NoError(t, err)
	req.Header.Set("Expect", "100-continue")
	tr := &Transport{Base: base, Retry: RetryPolicy{MaxAttempts: 1}}
	resp, err := tr.RoundTrip(req)
	require.Error(t, err)
	require.Positive(t, headers.Load(), "the server had the request's headers")
	assert.Equal(t, OutcomeUnknown, OutcomeOf(resp, err), "err: %v", err)
}

// TestOutcomeNotSentWhenNoHeadersWritten: a refused dial writes no headers,
// whatever the body: not sent, for a POST without a body too (which
// net/http would re-send after a write, so the body alone could not tell).
func TestOutcomeNotSentWhenNoHeadersWritten(t *testing.T) {
	url := closedURL(t)
	for _, body := range []io.Reader{nil, strings.NewReader(`{"amount":4200}`)} {
		req, err := http.NewRequest(http.MethodPost, url, body)
		require.NoError(t, err)
		resp, err := (&Transport{Base: &http.Transport{}, Retry: RetryPolicy{MaxAttempts: 1}}).RoundTrip(req)
		require.Error(t, err)
		assert.Equal(t, OutcomeNotSent, OutcomeOf(resp, err), "err: %v", err)
	}
}

// writeFrame writes one HTTP/2 frame.
func writeFrame(w io.Writer, typ, flags byte, stream uint32, payload []byte) {
	n := len(payload)
	f := []byte{byte(n >> 16), byte(n >> 8), byte(n), typ, flags, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(f[5:], stream)
	_, _ = w.Write(append(f, payload...))
}

// readFrame reads one HTTP/2 frame and skips its payload.
func readFrame(r io.Reader) (typ, flags byte, stream uint32, err error) {
	var h [9]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return 0, 0, 0, err
	}
	n := int64(h[0])<<16 | int64(h[1])<<8 | int64(h[2])
	if _, err := io.CopyN(io.Discard, r, n); err != nil {
		return 0, 0, 0, err
	}
	return h[3], h[4], binary.BigEndian.Uint32(h[5:]) & 0x7fffffff, nil
}

// closedURL returns the URL of a port on 127.0.0.1 that nothing listens on.
func closedURL(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ln.Close()
	return "http://" + ln.Addr().String()
}

// TestNotSentRefusalAfterHeadersWrittenIsUnknown: a Base that sends a try
// through net/http, then refuses the next with ErrNotSent (a breaker that
// opened inside a Base that retries), does not make the attempt not sent:
// the trace saw the first try's headers go out.
func TestNotSentRefusalAfterHeadersWrittenIsUnknown(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	defer srv.Close()
	base := roundTripFunc(func(req *http.Request) (*http.Response, error) {
		resp, err := srv.Client().Transport.RoundTrip(req)
		if err == nil {
			resp.Body.Close()
		}
		return nil, fmt.Errorf("%w: breaker open after a 503", ErrNotSent)
	})
	req, err := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{}`))
	require.NoError(t, err)
	resp, err := (&Transport{Base: base, Retry: fastPolicy}).RoundTrip(req)
	require.ErrorIs(t, err, ErrNotSent)
	assert.Equal(t, OutcomeUnknown, OutcomeOf(resp, err))
}
