package idem

import (
	"context"
	"net/http"
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
