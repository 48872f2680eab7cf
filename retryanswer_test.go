package idem

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// cutThen is a server that cuts the connection of its first request after
// reading it (the request may have been processed), and answers the
// others with status.
func cutThen(t *testing.T, status int) *httptest.Server {
	t.Helper()
	var n atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) == 1 {
			if conn, _, err := w.(http.Hijacker).Hijack(); err == nil {
				conn.Close()
			}
			return
		}
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(status)
		_, _ = w.Write([]byte(`{"title":"no"}`))
	}))
	t.Cleanup(srv.Close)
	return srv
}

// TestRefusalOfRetryAfterUnknownIsUnknown: after an attempt whose outcome
// is unknown (its connection cut once the server had it), a 401, 403, 404
// or 400 to the retry refuses the retry and says nothing of the first
// attempt: the outcome is unknown, through RoundTrip, http.Client and
// Client alike. The same status to a first attempt is done.
func TestRefusalOfRetryAfterUnknownIsUnknown(t *testing.T) {
	for _, status := range []int{http.StatusBadRequest, http.StatusUnauthorized, http.StatusForbidden, http.StatusNotFound} {
		t.Run(http.StatusText(status), func(t *testing.T) {
			srv := cutThen(t, status)
			tr := &Transport{Base: srv.Client().Transport, Retry: fastPolicy}

			resp, err := post(t, tr, context.Background(), srv.URL, `{"amount":4200}`)
			require.NoError(t, err)
			resp.Body.Close()
			assert.Equal(t, status, resp.StatusCode)
			assert.Equal(t, OutcomeUnknown, OutcomeOf(resp, err), "RoundTrip")

			srv = cutThen(t, status)
			tr.Base = srv.Client().Transport
			req, err := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{}`))
			require.NoError(t, err)
			resp, err = (&http.Client{Transport: tr}).Do(req)
			require.NoError(t, err)
			resp.Body.Close()
			assert.Equal(t, OutcomeUnknown, OutcomeOf(resp, err), "http.Client")

			srv = cutThen(t, status)
			tr.Base = srv.Client().Transport
			c := &Client{BaseURL: srv.URL, HTTPClient: &http.Client{Transport: tr}}
			resp, err = c.Post(context.Background(), "/", map[string]int{"amount": 4200}, nil)
			var apiErr *APIError
			require.ErrorAs(t, err, &apiErr)
			assert.Equal(t, OutcomeUnknown, OutcomeOf(nil, err), "Client, the error alone")
			assert.Equal(t, OutcomeUnknown, OutcomeOf(resp, err), "Client")
		})
	}
}

// TestRefusalOfFirstAttemptIsDone: a 403 to the first attempt, or to a
// retry after attempts that were not sent, is the server's final answer.
func TestRefusalOfFirstAttemptIsDone(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusForbidden)
	}))
	defer srv.Close()
	resp, err := post(t, &Transport{Base: srv.Client().Transport, Retry: fastPolicy}, context.Background(), srv.URL, `{}`)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, OutcomeDone, OutcomeOf(resp, err))

	// The first attempt to a closed port: refused, not sent, retried.
	closed := closedURL(t)
	var n atomic.Int32
	base := roundTripFunc(func(req *http.Request) (*http.Response, error) {
		if n.Add(1) == 1 {
			req = req.Clone(req.Context())
			req.URL.Host = strings.TrimPrefix(closed, "http://")
		}
		return srv.Client().Transport.RoundTrip(req)
	})
	resp, err = post(t, &Transport{Base: base, Retry: fastPolicy}, context.Background(), srv.URL, `{}`)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, int32(2), n.Load())
	assert.Equal(t, OutcomeDone, OutcomeOf(resp, err), "after an attempt not sent")
}

// TestRefusalOfRetryAfterUnknownThroughAnotherRequest: a Base that answers
// with a response whose Request is one of its own (a clone without the
// attempt's context) does not hide that the refusal answered a retry.
func TestRefusalOfRetryAfterUnknownThroughAnotherRequest(t *testing.T) {
	srv := cutThen(t, http.StatusForbidden)
	base := roundTripFunc(func(req *http.Request) (*http.Response, error) {
		return srv.Client().Transport.RoundTrip(req.Clone(context.Background()))
	})
	resp, err := post(t, &Transport{Base: base, Retry: fastPolicy}, context.Background(), srv.URL, `{}`)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, OutcomeUnknown, OutcomeOf(resp, err))
}
