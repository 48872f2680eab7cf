package idem

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// cutCreatedThen answers its first request 201 with a body cut half-way
// (the payment was made), and the others with then.
func cutCreatedThen(t *testing.T, then func(w http.ResponseWriter)) *httptest.Server {
	t.Helper()
	var n atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) == 1 {
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Content-Length", "40")
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte(`{"id":"pay_`))
			w.(http.Flusher).Flush()
			panic(http.ErrAbortHandler) // the rest of the body is lost
		}
		then(w)
	}))
	srv.Config.ErrorLog = discardLog()
	t.Cleanup(srv.Close)
	return srv
}

// TestLostCreatedAnswerIsNeverARefusal: a 201 whose body is cut is retried
// with the same key to read the replay; when the retry is refused (403),
// or fails in other ways, the call ends with an AnswerLostError that
// names the 201 and the key, and the outcome is done: it happened.
func TestLostCreatedAnswerIsNeverARefusal(t *testing.T) {
	for name, then := range map[string]func(http.ResponseWriter){
		"403": func(w http.ResponseWriter) { w.WriteHeader(http.StatusForbidden) },
		"422": func(w http.ResponseWriter) { w.WriteHeader(http.StatusUnprocessableEntity) },
		"503": func(w http.ResponseWriter) { w.WriteHeader(http.StatusServiceUnavailable) },
	} {
		t.Run(name, func(t *testing.T) {
			srv := cutCreatedThen(t, then)
			var keys []string
			tr := &Transport{Base: srv.Client().Transport, Retry: fastPolicy, OnAttempt: func(a Attempt) { keys = append(keys, a.Key) }}
			resp, err := post(t, tr, context.Background(), srv.URL, `{"amount":4200}`)
			require.Error(t, err)
			assert.Nil(t, resp)
			var lost *AnswerLostError
			require.ErrorAs(t, err, &lost)
			assert.Equal(t, http.StatusCreated, lost.StatusCode)
			require.NotEmpty(t, keys)
			assert.Equal(t, keys[0], lost.Key)
			assert.Contains(t, err.Error(), name)
			var reuse *KeyReuseError
			assert.False(t, errors.As(err, &reuse), "no refusal in the chain")
			assert.Equal(t, OutcomeDone, OutcomeOf(resp, err))

			c := &Client{BaseURL: cutCreatedThen(t, then).URL, HTTPClient: &http.Client{Transport: &Transport{Retry: fastPolicy}}}
			resp, err = c.Post(context.Background(), "/", map[string]int{"amount": 4200}, nil)
			require.ErrorAs(t, err, &lost)
			assert.Equal(t, http.StatusCreated, lost.StatusCode)
			assert.Equal(t, OutcomeDone, OutcomeOf(resp, err))
		})
	}
}

// TestLostCreatedAnswerRecoveredByReplay: the retry's replay completes the
// answer, which is returned as any 2xx.
func TestLostCreatedAnswerRecoveredByReplay(t *testing.T) {
	srv := cutCreatedThen(t, func(w http.ResponseWriter) {
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":"pay_1"}`))
	})
	resp, err := post(t, &Transport{Base: srv.Client().Transport, Retry: fastPolicy}, context.Background(), srv.URL, `{}`)
	require.NoError(t, err)
	assert.Equal(t, `{"id":"pay_1"}`, readAll(t, resp))
	assert.Equal(t, OutcomeDone, OutcomeOf(resp, err))
}
