package idem_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/server/idempotency"
)

// firstSentServer answers from a script of statuses (the last repeats) and
// records the first-sent header of every request, under the given name.
type firstSentServer struct {
	header string
	script []int
	mu     sync.Mutex
	got    [][]string
}

func (s *firstSentServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	io.Copy(io.Discard, r.Body)
	s.mu.Lock()
	s.got = append(s.got, r.Header.Values(s.header))
	status := s.script[min(len(s.got), len(s.script))-1]
	s.mu.Unlock()
	w.WriteHeader(status)
}

func (s *firstSentServer) values() [][]string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([][]string(nil), s.got...)
}

func sendFS(t *testing.T, tr *idem.Transport, ctx context.Context, method, url string, header http.Header) (*http.Response, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, method, url, strings.NewReader(`{"amount":1}`))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := tr.RoundTrip(req)
	if resp != nil {
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	return resp, err
}

func fsTransport(t *testing.T) *idem.Transport {
	base := &http.Transport{}
	t.Cleanup(base.CloseIdleConnections)
	return &idem.Transport{Base: base, Retry: idem.RetryPolicy{InitialInterval: time.Millisecond, MaxInterval: time.Millisecond}}
}

// TestFirstSentOnEveryAttempt: every attempt of a keyed operation says
// when the operation was first sent, the same on every retry; a time
// pinned with WithFirstSent is sent instead; one the request carries is
// sent as it is; unkeyed requests carry none, and NoFirstSent sends none.
func TestFirstSentOnEveryAttempt(t *testing.T) {
	srv := &firstSentServer{header: idem.DefaultFirstSentHeader, script: []int{503, 503, 201}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	tr := fsTransport(t)

	before := time.Now().Truncate(time.Second)
	_, err := sendFS(t, tr, context.Background(), "POST", ts.URL, nil)
	require.NoError(t, err)
	got := srv.values()
	require.Len(t, got, 3)
	require.Len(t, got[0], 1)
	at, err := http.ParseTime(got[0][0])
	require.NoError(t, err)
	assert.False(t, at.Before(before) || at.After(time.Now()), "first sent %v, want the call's start", at)
	assert.Equal(t, got[0], got[1])
	assert.Equal(t, got[0], got[2])

	pinned := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	srv.got, srv.script = nil, []int{201}
	_, err = sendFS(t, tr, idem.WithFirstSent(context.Background(), pinned), "PATCH", ts.URL, nil)
	require.NoError(t, err)
	_, err = sendFS(t, tr, context.Background(), "POST", ts.URL, http.Header{idem.DefaultFirstSentHeader: {"Tue, 01 Dec 2026 09:00:00 GMT"}})
	require.NoError(t, err)
	_, err = sendFS(t, tr, idem.WithFirstSent(context.Background(), pinned), "GET", ts.URL, nil)
	require.NoError(t, err)
	assert.Equal(t, [][]string{{"Tue, 01 Dec 2026 10:00:00 GMT"}, {"Tue, 01 Dec 2026 09:00:00 GMT"}, nil}, srv.values())

	srv.got = nil
	off := fsTransport(t)
	off.NoFirstSent = true
	_, err = sendFS(t, off, context.Background(), "POST", ts.URL, nil)
	require.NoError(t, err)
	other := fsTransport(t)
	other.FirstSentHeader = "x-first-sent"
	other.KeyBodyField = "idempotency_key" // no key header: the time still goes
	srv2 := &firstSentServer{header: "X-First-Sent", script: []int{201}}
	ts2 := httptest.NewServer(srv2)
	defer ts2.Close()
	_, err = sendFS(t, other, context.Background(), "POST", ts2.URL, nil)
	require.NoError(t, err)
	assert.Equal(t, [][]string{nil}, srv.values())
	require.Len(t, srv2.values(), 1)
	assert.Len(t, srv2.values()[0], 1)
}

// TestFirstSentCarriedUnderAnotherSpelling: a first-sent header the
// request carries under a spelling of its own, set in the map directly, is
// sent as it is, and no second one beside it, whether the key goes in a
// header or in the body.
func TestFirstSentCarriedUnderAnotherSpelling(t *testing.T) {
	srv := &firstSentServer{header: idem.DefaultFirstSentHeader, script: []int{201}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	carried := http.Header{"repeatability-first-sent": {"Tue, 01 Dec 2026 09:00:00 GMT"}}
	_, err := sendFS(t, fsTransport(t), context.Background(), "POST", ts.URL, carried)
	require.NoError(t, err)
	body := fsTransport(t)
	body.KeyBodyField = "idempotency_key"
	_, err = sendFS(t, body, context.Background(), "POST", ts.URL, carried)
	require.NoError(t, err)
	want := []string{"Tue, 01 Dec 2026 09:00:00 GMT"}
	assert.Equal(t, [][]string{want, want}, srv.values())
}

// TestKeyExpiredError: idem's server side refuses a keyed request first
// sent longer ago than it keeps keys, whose key is gone, with 410: the
// call ends in a KeyExpiredError, after one attempt, its outcome unknown,
// through http.Client too. Another 410 is returned as it came, its body
// whole.
func TestKeyExpiredError(t *testing.T) {
	var runs atomic.Int32
	h := idempotency.Middleware(idempotency.NewMemoryStore(), idempotency.Options{
		Retention: time.Hour,
		ClientID:  func(*http.Request) (string, bool) { return "c", true },
	})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
	}))
	ts := httptest.NewServer(h)
	defer ts.Close()
	var attempts atomic.Int32
	tr := fsTransport(t)
	tr.OnAttempt = func(idem.Attempt) { attempts.Add(1) }
	client := &http.Client{Transport: tr}

	firstSent := time.Now().Add(-2 * time.Hour)
	ctx := idem.WithFirstSent(idem.WithKey(context.Background(), "k-old"), firstSent)
	req, _ := http.NewRequestWithContext(ctx, "POST", ts.URL+"/v1/payments", strings.NewReader(`{}`))
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if resp != nil {
		resp.Body.Close()
	}
	var expired *idem.KeyExpiredError
	require.True(t, errors.As(err, &expired), "err = %v", err)
	assert.Equal(t, "k-old", expired.Key)
	assert.Equal(t, firstSent.Unix(), expired.FirstSent.Unix())
	assert.Equal(t, idem.ProblemKeyExpired, expired.Problem.Type)
	assert.Equal(t, idem.OutcomeUnknown, idem.OutcomeOf(nil, err))
	assert.Contains(t, err.Error(), "check whether it took effect")
	assert.Equal(t, int32(1), attempts.Load(), "attempts")
	assert.Zero(t, runs.Load(), "the handler ran")

	// A new operation with the key of today: run.
	_, err = sendFS(t, tr, context.Background(), "POST", ts.URL+"/v1/payments", nil)
	require.NoError(t, err)
	assert.Equal(t, int32(1), runs.Load())

	// Another 410: returned, its body whole.
	gone := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(http.StatusGone)
		io.WriteString(w, `{"type":"https://example.com/order-gone","title":"Gone","detail":"`+strings.Repeat("x", 8000)+`"}`)
	}))
	defer gone.Close()
	req, _ = http.NewRequest("POST", gone.URL, strings.NewReader(`{}`))
	resp, err = tr.RoundTrip(req)
	require.NoError(t, err)
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	assert.Equal(t, http.StatusGone, resp.StatusCode)
	assert.Len(t, b, len(`{"type":"https://example.com/order-gone","title":"Gone","detail":""}`)+8000)
}
