package idempotency

import (
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// latch is a channel closed once. A test that holds a handler on it
// defers Do, so that the handler is let go whatever happens, before the
// server's cleanup waits for it.
type latch struct {
	C    chan struct{}
	once sync.Once
}

func (l *latch) Do() { l.once.Do(func() { close(l.C) }) }

// holdFirst returns the channel a held handler closes when it runs, and the
// latch that lets it go.
func holdFirst() (entered chan struct{}, release *latch) {
	return make(chan struct{}), &latch{C: make(chan struct{})}
}

// TestOneTransactionDuplicates holds the first request of a key claimed in
// one transaction in its handler: its duplicates, same body or not, get 409
// at once, before it is let go, and no lease is renewed meanwhile though
// the lock timeout passes many times (on the bubble's clock). Once it
// completed, the duplicate gets the replay and another body 422.
func TestOneTransactionDuplicates(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var ev events
		entered, release := holdFirst()
		defer release.Do()
		var calls atomic.Int32
		h := testHandler(t, NewMemoryStore(), Options{OneTransaction: true, LockTimeout: testLease, OnEvent: ev.add},
			func(w http.ResponseWriter, r *http.Request) {
				claim, _ := ClaimFromContext(r.Context())
				assert.True(t, claim.OneTransaction, "claim of the first request: %+v", claim)
				if calls.Add(1) == 1 {
					close(entered)
					<-release.C
				}
				w.WriteHeader(http.StatusCreated)
				fmt.Fprintf(w, "order %d", calls.Load())
			})
		first := make(chan reply, 1)
		go func() { first <- serve(t, h, keyed("k", `{"a":1}`)) }()
		<-entered
		for _, body := range []string{`{"a":1}`, `{"a":2}`} {
			r := serve(t, h, keyed("k", body)) // answered while the first is held
			require.Equal(t, http.StatusConflict, r.status, "duplicate %s while the first runs: %s", body, r.body)
			assert.Equal(t, ProblemKeyInUse, r.problem(t).Type)
			assert.Equal(t, "1", r.header.Get("Retry-After"))
		}
		time.Sleep(10 * testLease) // held
		release.Do()
		r := <-first
		require.Equal(t, http.StatusCreated, r.status)
		assert.Zero(t, ev.count(EventRenewed), "renewals of a claim in one transaction")
		assert.Equal(t, 2, ev.count(EventConflict))

		again := serve(t, h, keyed("k", `{"a":1}`))
		assert.True(t, again.replayed())
		assert.Equal(t, "order 1", string(again.body))
		other := serve(t, h, keyed("k", `{"a":2}`))
		assert.Equal(t, http.StatusUnprocessableEntity, other.status)
		assert.EqualValues(t, 1, calls.Load())
	})
}

// TestOneTransactionFailureLeavesNoKey fails the first request of a key
// claimed in one transaction with a 500, a panic, and a 400: its staged
// write is dropped, and the key with it, so that even another request
// with the key runs at once as a new operation (another OperationID),
// where a key claimed in its own commit would answer 422 after a 500 or a
// panic.
func TestOneTransactionFailureLeavesNoKey(t *testing.T) {
	for _, fail := range []string{"500", "panic", "400"} {
		t.Run(fail, func(t *testing.T) {
			var ev events
			store := NewMemoryStore()
			var mu sync.Mutex
			written := map[string]bool{}
			var ops []string
			ts := mwServer(t, store, Options{OneTransaction: true, OnEvent: ev.add},
				func(w http.ResponseWriter, r *http.Request) {
					claim, _ := ClaimFromContext(r.Context())
					mu.Lock()
					ops = append(ops, claim.OperationID)
					n := len(ops)
					mu.Unlock()
					name := fmt.Sprint("order-", n)
					require.True(t, store.Stage(r.Context(), func() error {
						mu.Lock()
						defer mu.Unlock()
						written[name] = true
						return nil
					}))
					if n == 1 {
						switch fail {
						case "panic":
							panic(http.ErrAbortHandler)
						case "500":
							w.WriteHeader(http.StatusInternalServerError)
						case "400":
							w.WriteHeader(http.StatusBadRequest)
						}
						return
					}
					w.WriteHeader(http.StatusCreated)
				})
			first := ts.send(t, keyed("k", `{"a":1}`))
			if fail != "panic" {
				require.NoError(t, first.err)
			}
			second := ts.mustSend(t, keyed("k", `{"a":2}`)) // another request: no 422
			require.Equal(t, http.StatusCreated, second.status, "another request after the first failed: %s", second.body)
			mu.Lock()
			defer mu.Unlock()
			require.Len(t, ops, 2)
			assert.NotEqual(t, ops[0], ops[1], "the retry resumed the failed operation")
			assert.Equal(t, map[string]bool{"order-2": true}, written)
			assert.Equal(t, 1, ev.count(EventReleased))
			assert.Equal(t, 1, ev.count(EventCompleted))
		})
	}
}

// TestOneTransactionRetryKeepsOperation fails the first request of a key
// claimed in one transaction with a 500: its key goes with the rollback,
// and the retry of the same request runs under the same OperationID, so
// that a downstream call keyed by it is found, not made again.
func TestOneTransactionRetryKeepsOperation(t *testing.T) {
	var mu sync.Mutex
	var ops []string
	ts := mwServer(t, NewMemoryStore(), Options{OneTransaction: true}, func(w http.ResponseWriter, r *http.Request) {
		claim, _ := ClaimFromContext(r.Context())
		mu.Lock()
		ops = append(ops, claim.OperationID)
		n := len(ops)
		mu.Unlock()
		if n == 1 {
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	require.Equal(t, http.StatusInternalServerError, ts.mustSend(t, keyed("k", `{"a":1}`)).status)
	require.Equal(t, http.StatusCreated, ts.mustSend(t, keyed("k", `{"a":1}`)).status)
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, ops, 2)
	assert.Equal(t, ops[0], ops[1], "the retry of the same request got another operation")
}

// TestOneTransactionWaitForCompletion holds the first request of a key
// claimed in one transaction: a duplicate with WaitForCompletion waits for
// it, and gets its replay.
func TestOneTransactionWaitForCompletion(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		entered, release := holdFirst()
		defer release.Do()
		var calls atomic.Int32
		h := testHandler(t, NewMemoryStore(), Options{OneTransaction: true, WaitForCompletion: time.Minute},
			func(w http.ResponseWriter, r *http.Request) {
				if calls.Add(1) == 1 {
					close(entered)
					<-release.C
				}
				w.WriteHeader(http.StatusCreated)
			})
		first := make(chan reply, 1)
		go func() { first <- serve(t, h, keyed("k", `{}`)) }()
		<-entered
		dup := make(chan reply, 1)
		go func() { dup <- serve(t, h, keyed("k", `{}`)) }()
		synctest.Wait() // the duplicate waits for the first
		release.Do()
		require.Equal(t, http.StatusCreated, (<-first).status)
		r := <-dup
		assert.Equal(t, http.StatusCreated, r.status)
		assert.True(t, r.replayed())
		assert.EqualValues(t, 1, calls.Load())
	})
}
