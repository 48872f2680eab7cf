package idem

import (
	"context"
	"net/http"
	"net/url"
	"strings"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// conflictThen answers 409 (Retry-After: 1) n times, calling last as the
// n-th arrives, then 201.
func conflictThen(n int, last func()) []answer {
	var script []answer
	for i := 1; i <= n; i++ {
		script = append(script, func(req *http.Request) (*http.Response, error) {
			if i == n {
				last()
			}
			return replyBody(409, "application/problem+json", `{"title":"Request in progress"}`, "Retry-After", "1")(req)
		})
	}
	return append(script, reply(201))
}

// TestSynctestInProgressCountsEvery409 checks that InProgressError.Polls
// counts the 409 that arrives as the context ends, like those before it.
func TestSynctestInProgressCountsEvery409(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		srv := newFake(conflictThen(3, cancel)...)
		_, err := fakePost(t, &Transport{Base: srv}, ctx)
		var inprog *InProgressError
		require.ErrorAs(t, err, &inprog)
		assert.Len(t, srv.at, 3)
		assert.Equal(t, 3, inprog.Polls, "every 409 is a poll, the last one too")
		assert.Equal(t, 2*time.Second, inprog.Waited, "from the first 409 to the last")
		assert.ErrorIs(t, err, context.Canceled)
	})
}

// TestSynctestRetryErrorTimeout checks that a RetryError says whether a
// timeout ended the operation, so that url.Error.Timeout, which asks the
// error http.Client wraps, answers for the operation.
func TestSynctestRetryErrorTimeout(t *testing.T) {
	for _, tt := range []struct {
		name   string
		policy RetryPolicy
		ctx    time.Duration // the context's timeout; 0: none
		base   roundTripFunc
		want   bool
	}{
		{"attempt timeouts", RetryPolicy{AttemptTimeout: time.Second, MaxAttempts: 2}, 0, blockUntilDone, true},
		{"context deadline", RetryPolicy{}, 5 * time.Second, blockUntilDone, true},
		{"MaxElapsedTime", RetryPolicy{MaxElapsedTime: 3 * time.Second}, 0, blockUntilDone, true},
		{"net timeout", RetryPolicy{MaxAttempts: 2}, 0, roundTripFunc(fail(urlErr(netError{timeout: true}))), true},
		{"connection refused", RetryPolicy{MaxAttempts: 2}, 0, roundTripFunc(fail(dialErr(syscall.ECONNREFUSED))), false},
		{"connection reset", RetryPolicy{MaxAttempts: 2}, 0, roundTripFunc(fail(readErr(syscall.ECONNRESET))), false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				ctx := contextWithin(t, tt.ctx)
				client := &http.Client{Transport: &Transport{Base: tt.base, Retry: tt.policy, DisableBudget: true}}
				req, err := http.NewRequestWithContext(ctx, http.MethodPost, mockURL, strings.NewReader(`{}`))
				require.NoError(t, err)
				_, err = client.Do(req)
				var rerr *RetryError
				require.ErrorAs(t, err, &rerr)
				assert.Equal(t, tt.want, rerr.Timeout())
				var uerr *url.Error
				require.ErrorAs(t, err, &uerr)
				assert.Equal(t, tt.want, uerr.Timeout(), "url.Error.Timeout of %v", err)
			})
		})
	}
}

// TestSynctestPollCutShortIsInProgress checks that a poll of a request
// still running (the attempt after a 409) cut short by the context or by
// MaxElapsedTime ends in an InProgressError, as a wait between polls cut
// short does: the last word from the server was that the key is running.
func TestSynctestPollCutShortIsInProgress(t *testing.T) {
	for _, tt := range []struct {
		name    string
		policy  RetryPolicy
		timeout time.Duration
		want    error
	}{
		{"context deadline", RetryPolicy{}, 5 * time.Second, context.DeadlineExceeded},
		{"MaxElapsedTime", RetryPolicy{MaxElapsedTime: 5 * time.Second}, 0, context.DeadlineExceeded},
	} {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				ctx := contextWithin(t, tt.timeout)
				var as attempts
				srv := newFake(replyBody(409, "application/problem+json", `{"title":"Request in progress"}`, "Retry-After", "1"), blockUntilDone)
				_, err := fakePost(t, &Transport{Base: srv, Retry: tt.policy, OnAttempt: as.hook}, ctx)
				var inprog *InProgressError
				require.ErrorAs(t, err, &inprog, "got %v", err)
				assert.Equal(t, srv.keys[0], inprog.Key)
				assert.Equal(t, 1, inprog.Polls)
				require.NotNil(t, inprog.Problem)
				assert.Equal(t, "Request in progress", inprog.Problem.Title)
				assert.ErrorIs(t, err, tt.want)
				require.Len(t, as, 2, "both attempts are reported")
				assert.Error(t, as[1].Err)
				assert.False(t, as[1].Retry)
			})
		})
	}
}

// contextWithin returns a context that ends after timeout, if positive,
// and when the test ends.
func contextWithin(t *testing.T, timeout time.Duration) context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	if timeout > 0 {
		ctx, cancel = context.WithTimeout(ctx, timeout)
	}
	t.Cleanup(cancel)
	return ctx
}
