package idem

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestContentLengthMismatchRefusedBeforeSending: a request whose
// ContentLength disagrees with its in-memory body, or that has a
// ContentLength and no body, is refused at once, unsent and unretried.
func TestContentLengthMismatchRefusedBeforeSending(t *testing.T) {
	var requests atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { requests.Add(1) }))
	defer srv.Close()
	for _, body := range []io.Reader{strings.NewReader("hello"), nil} {
		req, err := http.NewRequest(http.MethodPost, srv.URL, body)
		require.NoError(t, err)
		req.ContentLength = 100
		var attempts int
		tr := &Transport{Base: srv.Client().Transport, Retry: fastPolicy, OnAttempt: func(Attempt) { attempts++ }}
		resp, err := tr.RoundTrip(req)
		require.Error(t, err)
		assert.Contains(t, err.Error(), "ContentLength=100")
		assert.Zero(t, attempts)
		assert.Equal(t, OutcomeNotSent, OutcomeOf(resp, err))
	}
	assert.Zero(t, requests.Load())
}

// failingBody is a request body of the caller's own whose Read fails.
type failingBody struct{ err error }

func (b failingBody) Read([]byte) (int, error) { return 0, b.err }
func (failingBody) Close() error               { return nil }

// shortBody is a request body of the caller's own that gives fewer bytes
// than its ContentLength says.
func shortBody() io.ReadCloser { return io.NopCloser(io.LimitReader(strings.NewReader("hello"), 5)) }

// TestLocalBodyErrorsNotRetried: a body whose own Read fails, and one
// shorter than its ContentLength, fail the same way on every attempt: the
// call ends after one attempt, with the body's error in its chain. Over
// HTTP/1.1, net/http flushes the headers before it reads such a body, so
// the server may have the request: the outcome is unknown, not "not sent".
func TestLocalBodyErrorsNotRetried(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) { _, _ = io.ReadAll(r.Body) }))
	defer srv.Close()
	broken := errors.New("disk on fire")
	for name, tt := range map[string]struct {
		body   func() io.ReadCloser
		length int64
		want   string
	}{
		"read fails":                 {func() io.ReadCloser { return failingBody{broken} }, 10, "disk on fire"},
		"short body":                 {shortBody, 100, "ContentLength=100 with Body length 5"},
		"read fails, unknown length": {func() io.ReadCloser { return failingBody{broken} }, -1, "disk on fire"},
	} {
		t.Run(name, func(t *testing.T) {
			req, err := http.NewRequest(http.MethodPost, srv.URL, nil)
			require.NoError(t, err)
			req.Body, req.ContentLength = tt.body(), tt.length
			req.GetBody = func() (io.ReadCloser, error) { return tt.body(), nil }
			var attempts int
			tr := &Transport{Base: srv.Client().Transport, Retry: fastPolicy, OnAttempt: func(Attempt) { attempts++ }}
			resp, err := tr.RoundTrip(req)
			require.Error(t, err)
			assert.Contains(t, err.Error(), tt.want)
			assert.Equal(t, 1, attempts, "not retried")
			var rerr *RetryError
			require.ErrorAs(t, err, &rerr)
			assert.NotEmpty(t, rerr.Key)
			assert.Equal(t, OutcomeUnknown, OutcomeOf(resp, err), "the headers were flushed before the body was read")
		})
	}
}

// TestLocalBodyErrorNotRetriedOverHTTP2: the same over HTTP/2, where the
// body's error resets the stream after its headers went out.
func TestLocalBodyErrorNotRetriedOverHTTP2(t *testing.T) {
	srv := newHTTP2Server(t, http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) { _, _ = io.ReadAll(r.Body) }))
	broken := errors.New("disk on fire")
	req, err := http.NewRequest(http.MethodPost, srv.URL, nil)
	require.NoError(t, err)
	req.Body, req.ContentLength = failingBody{broken}, 10
	req.GetBody = func() (io.ReadCloser, error) { return failingBody{broken}, nil }
	var attempts int
	tr := &Transport{Base: srv.Client().Transport, Retry: fastPolicy, OnAttempt: func(Attempt) { attempts++ }}
	resp, err := tr.RoundTrip(req)
	require.ErrorIs(t, err, broken)
	assert.Equal(t, 1, attempts, "not retried")
	assert.Equal(t, OutcomeUnknown, OutcomeOf(resp, err))
}
