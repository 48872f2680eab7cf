package idem

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// firstSentRecorder is a base that records the first-sent header of every
// attempt, and answers each with answer.
type firstSentRecorder struct {
	mu     sync.Mutex
	sent   []string
	answer answer
}

func (r *firstSentRecorder) RoundTrip(req *http.Request) (*http.Response, error) {
	r.mu.Lock()
	r.sent = append(r.sent, req.Header.Get(DefaultFirstSentHeader))
	r.mu.Unlock()
	return r.answer(req)
}

func (r *firstSentRecorder) all() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.sent...)
}

// postWith sends a keyed POST with ctx through tr.
func postWith(t *testing.T, tr *Transport, ctx context.Context) (*http.Response, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "https://api.example.com/v1/payments", strings.NewReader(`{"amount":4200}`))
	require.NoError(t, err)
	resp, err := tr.RoundTrip(req)
	if resp != nil {
		resp.Body.Close()
	}
	return resp, err
}

// TestPinnedKeyKeepsItsFirstSentTime: a key pinned with WithKey alone,
// sent again an hour later, carries the first-sent time of its first
// call, not the time of the new one, so a server that let the key go can
// refuse it; the same through a key header of the caller's own.
func TestPinnedKeyKeepsItsFirstSentTime(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		rec := &firstSentRecorder{answer: reply(http.StatusCreated)}
		tr := &Transport{Base: rec}
		ctx := WithKey(context.Background(), "order-1")
		_, err := postWith(t, tr, ctx)
		require.NoError(t, err)
		time.Sleep(time.Hour)
		_, err = postWith(t, tr, ctx)
		require.NoError(t, err)

		req, err := http.NewRequest(http.MethodPost, "https://api.example.com/v1/payments", strings.NewReader(`{}`))
		require.NoError(t, err)
		req.Header.Set(DefaultKeyHeader, "order-1")
		resp, err := tr.RoundTrip(req)
		require.NoError(t, err)
		resp.Body.Close()

		sent := rec.all()
		require.Len(t, sent, 3)
		assert.Equal(t, []string{sent[0], sent[0], sent[0]}, sent)

		// Another key is new: its own time.
		_, err = postWith(t, tr, WithKey(context.Background(), "order-2"))
		require.NoError(t, err)
		assert.NotEqual(t, sent[0], rec.all()[3])

		// The same key on another host is another operation.
		req, err = http.NewRequestWithContext(ctx, http.MethodPost, "https://other.example.com/v1/payments", strings.NewReader(`{}`))
		require.NoError(t, err)
		resp, err = tr.RoundTrip(req)
		require.NoError(t, err)
		resp.Body.Close()
		assert.NotEqual(t, sent[0], rec.all()[4])
	})
}

// TestPinnedFirstSentTimeWins: WithFirstSent wins over the remembered
// time, and is remembered for the key if it was not yet.
func TestPinnedFirstSentTimeWins(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		rec := &firstSentRecorder{answer: reply(http.StatusCreated)}
		tr := &Transport{Base: rec}
		pinned := time.Now().Add(-2 * time.Hour)
		_, err := postWith(t, tr, WithFirstSent(WithKey(context.Background(), "order-1"), pinned))
		require.NoError(t, err)
		_, err = postWith(t, tr, WithKey(context.Background(), "order-1"))
		require.NoError(t, err)
		want := pinned.UTC().Format(http.TimeFormat)
		assert.Equal(t, []string{want, want}, rec.all())
	})
}

// TestNewKeyOfFailedCallKeepsItsFirstSentTime: a call whose key idem made
// fails; the caller reads the key from the error and asks again with it
// (WithKey alone): the first call's first-sent time goes with it.
func TestNewKeyOfFailedCallKeepsItsFirstSentTime(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		rec := &firstSentRecorder{answer: func(*http.Request) (*http.Response, error) {
			return nil, errors.New("connection reset")
		}}
		tr := &Transport{Base: rec, Retry: RetryPolicy{MaxAttempts: 1}}
		_, err := postWith(t, tr, context.Background())
		var rerr *RetryError
		require.ErrorAs(t, err, &rerr)
		time.Sleep(time.Hour)
		rec.answer = reply(http.StatusCreated)
		_, err = postWith(t, tr, WithKey(context.Background(), rerr.Key))
		require.NoError(t, err)
		sent := rec.all()
		assert.Equal(t, sent[0], sent[1])
	})
}

// TestFirstSentMemoryIsBounded: a key is forgotten once its first-sent
// time is older than FirstSentMemory, and the keys learnt first are
// forgotten beyond MaxRememberedKeys; a negative FirstSentMemory
// remembers nothing.
func TestFirstSentMemoryIsBounded(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		rec := &firstSentRecorder{answer: reply(http.StatusCreated)}
		tr := &Transport{Base: rec, FirstSentMemory: time.Hour}
		ctx := WithKey(context.Background(), "order-1")
		_, err := postWith(t, tr, ctx)
		require.NoError(t, err)
		time.Sleep(2 * time.Hour)
		_, err = postWith(t, tr, WithKey(context.Background(), "order-2")) // forgets order-1
		require.NoError(t, err)
		_, err = postWith(t, tr, ctx)
		require.NoError(t, err)
		sent := rec.all()
		assert.NotEqual(t, sent[0], sent[2], "forgotten after FirstSentMemory")
		tr.sent.mu.Lock()
		assert.Len(t, tr.sent.times, 2)
		tr.sent.mu.Unlock()

		for i := range MaxRememberedKeys + 10 {
			tr.sent.firstSent(fmt.Sprint("k", i), time.Now(), time.Hour)
		}
		tr.sent.mu.Lock()
		assert.Len(t, tr.sent.times, MaxRememberedKeys)
		_, kept := tr.sent.times["api.example.com order-1"]
		assert.False(t, kept, "the keys learnt first go first")
		assert.LessOrEqual(t, len(tr.sent.order), 2*MaxRememberedKeys)
		tr.sent.mu.Unlock()

		off := &Transport{Base: rec, FirstSentMemory: -1}
		_, err = postWith(t, off, ctx)
		require.NoError(t, err)
		assert.Nil(t, off.sent.times)
	})
}

// TestFirstSentMemoryConcurrent: calls with one key at once all carry one
// first-sent time (run with -race).
func TestFirstSentMemoryConcurrent(t *testing.T) {
	rec := &firstSentRecorder{answer: func(req *http.Request) (*http.Response, error) {
		resp := statusResponse(http.StatusCreated)
		resp.Body, resp.Request = http.NoBody, req
		return resp, nil
	}}
	tr := &Transport{Base: rec}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			_, err := postWith(t, tr, WithKey(context.Background(), "order-1"))
			assert.NoError(t, err)
		})
	}
	wg.Wait()
	sent := rec.all()
	for _, s := range sent {
		assert.Equal(t, sent[0], s)
	}
}

// TestBodyFieldKeyKeepsItsFirstSentTime: a key the caller put in the
// body's key field (Square's idempotency_key), sent again, carries its
// first-sent time too.
func TestBodyFieldKeyKeepsItsFirstSentTime(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		rec := &firstSentRecorder{answer: reply(http.StatusCreated)}
		tr := &Transport{Base: rec, Provider: Square}
		for range 2 {
			req, err := http.NewRequest(http.MethodPost, "https://connect.squareup.com/v2/payments", strings.NewReader(`{"idempotency_key":"order-1","amount_money":{"amount":4200}}`))
			require.NoError(t, err)
			resp, err := tr.RoundTrip(req)
			require.NoError(t, err)
			resp.Body.Close()
			time.Sleep(time.Hour)
		}
		sent := rec.all()
		require.Len(t, sent, 2)
		assert.Equal(t, sent[0], sent[1])
	})
}
