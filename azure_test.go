package idem

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// azureService is an httptest server that speaks OASIS Repeatable
// Requests as Azure Communication Services documents it: a request whose
// Repeatability-First-Sent is older than its 5-minute window is answered
// 412 with Repeatability-Result: rejected; others run, or replay, with
// Repeatability-Result: accepted.
type azureService struct {
	*httptest.Server
	mu      sync.Mutex
	headers []http.Header
	ran     map[string]int
}

func newAzureService(t *testing.T) *azureService {
	s := &azureService{ran: map[string]int{}}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		defer s.mu.Unlock()
		s.headers = append(s.headers, r.Header.Clone())
		id := r.Header.Get("Repeatability-Request-Id")
		sent, err := http.ParseTime(r.Header.Get("Repeatability-First-Sent"))
		switch {
		case id == "" || err != nil:
			w.Header().Set("Repeatability-Result", "rejected")
			w.WriteHeader(http.StatusBadRequest)
		case time.Since(sent) > 5*time.Minute:
			w.Header().Set("Repeatability-Result", "rejected")
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusPreconditionFailed)
			_, _ = w.Write([]byte(`{"error":{"code":"PreconditionFailed","message":"Repeatability-First-Sent header is not within 5 minutes window."}}`))
		default:
			s.ran[id]++
			w.Header().Set("Repeatability-Result", "accepted")
			w.WriteHeader(http.StatusAccepted)
		}
	}))
	t.Cleanup(s.Close)
	return s
}

// TestAzureRepeatableRequests: the key goes in Repeatability-Request-ID
// with Repeatability-First-Sent beside it; a first-sent time outside the
// service's window (412, Repeatability-Result: rejected) ends in a
// KeyExpiredError, unknown; a 412 of another kind (If-Match) is returned.
func TestAzureRepeatableRequests(t *testing.T) {
	svc := newAzureService(t)
	tr := &Transport{Base: svc.Client().Transport, Provider: Azure, Retry: fastPolicy}

	resp, err := post(t, tr, context.Background(), svc.URL, `{"to":"a@example.com"}`)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusAccepted, resp.StatusCode)
	h := svc.headers[0]
	assert.NotEmpty(t, h.Get("Repeatability-Request-Id"))
	assert.Empty(t, h.Get(DefaultKeyHeader), "no Idempotency-Key beside it")
	_, err = http.ParseTime(h.Get("Repeatability-First-Sent"))
	assert.NoError(t, err)

	firstSent := time.Now().Add(-10 * time.Minute)
	ctx := WithFirstSent(WithKey(context.Background(), NewKey()), firstSent)
	resp, err = post(t, tr, ctx, svc.URL, `{"to":"a@example.com"}`)
	assert.Nil(t, resp)
	var expired *KeyExpiredError
	require.ErrorAs(t, err, &expired)
	assert.Equal(t, firstSent, expired.FirstSent)
	assert.Contains(t, err.Error(), "not within 5 minutes")
	assert.Equal(t, OutcomeUnknown, OutcomeOf(resp, err))
	assert.Len(t, svc.headers, 2, "not retried")

	ifMatch := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusPreconditionFailed)
	}))
	defer ifMatch.Close()
	req, err := http.NewRequest(http.MethodPost, ifMatch.URL, strings.NewReader(`{}`))
	require.NoError(t, err)
	resp, err = tr.RoundTrip(req)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusPreconditionFailed, resp.StatusCode)
}
