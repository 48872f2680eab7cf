package idempotency

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// deadline puts a per-request deadline in front of h, as a service's own
// timeout middleware would.
func deadline(d time.Duration, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), d)
		defer cancel()
		h.ServeHTTP(w, r.WithContext(ctx))
	})
}

// mustNotRun checks that r says "not done, retry with the same key": 503
// ProblemUnavailable with Retry-After, never a 2xx.
func mustNotRun(t *testing.T, what string, r reply) {
	t.Helper()
	if r.status != http.StatusServiceUnavailable || r.header.Get("Retry-After") == "" {
		t.Errorf("%s: %d %q (Retry-After %q), want 503 with Retry-After", what, r.status, r.body, r.header.Get("Retry-After"))
		return
	}
	assert.Equal(t, ProblemUnavailable, r.problem(t).Type, what)
}

// TestMiddlewareContextEndsBeforeAnswer ends a keyed request's context at
// each point inside the middleware, as a deadline middleware in front of
// it or a server shutting down does: every such request gets a definite
// "not done, retry with the same key" (409 or 503 with Retry-After), never
// the empty 200 net/http sends for a handler that wrote nothing, and the
// retry with the key gets the one outcome.
func TestMiddlewareContextEndsBeforeAnswer(t *testing.T) {
	t.Run("waiting duplicate", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			var calls atomic.Int32
			opts := Options{WaitForCompletion: time.Minute}
			h := testHandler(t, NewMemoryStore(), opts, func(w http.ResponseWriter, r *http.Request) {
				calls.Add(1)
				time.Sleep(10 * time.Second)
				w.WriteHeader(http.StatusCreated)
			})
			first := make(chan reply)
			go func() { first <- serve(t, h, keyed("k", "{}")) }()
			synctest.Wait()
			// The duplicate's own deadline ends its wait long before the
			// first request or WaitForCompletion.
			r := serve(t, deadline(time.Second, h), keyed("k", "{}"))
			if r.status != http.StatusConflict || r.header.Get("Retry-After") == "" {
				t.Errorf("duplicate whose deadline ended its wait: %d %q, want 409 with Retry-After", r.status, r.body)
			} else {
				assert.Equal(t, ProblemKeyInUse, r.problem(t).Type)
			}
			assert.Equal(t, http.StatusCreated, (<-first).status)
			assert.Equal(t, int32(1), calls.Load())
		})
	})

	t.Run("before the claim", func(t *testing.T) {
		var calls atomic.Int32
		h := testHandler(t, NewMemoryStore(), Options{}, func(w http.ResponseWriter, r *http.Request) {
			calls.Add(1)
			w.WriteHeader(http.StatusCreated)
		})
		// The body arrived after the deadline: the context is done when
		// the middleware is about to claim.
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, keyed("k", "{}").request(t, "").WithContext(ctx))
		mustNotRun(t, "request whose context ended before the claim", recorded(rec))
		require.Equal(t, int32(0), calls.Load(), "the handler ran")
		r := serve(t, h, keyed("k", "{}"))
		assert.Equal(t, http.StatusCreated, r.status, "the retry: %s", r.body)
		assert.False(t, r.replayed())
	})

	t.Run("during the claim", func(t *testing.T) {
		mem := NewMemoryStore()
		var calls atomic.Int32
		handler := func(w http.ResponseWriter, r *http.Request) {
			calls.Add(1)
			w.WriteHeader(http.StatusCreated)
		}
		ctx, cancel := context.WithCancel(context.Background())
		opts := Options{Logger: testLogger(t)}
		h := withClient(Middleware(lateStore{mem, cancel}, opts)(http.HandlerFunc(handler)), opts)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, keyed("k", "{}").request(t, "").WithContext(ctx))
		mustNotRun(t, "request whose context ended during its claim", recorded(rec))
		require.Equal(t, int32(0), calls.Load(), "the handler ran")
		r := serve(t, testHandler(t, mem, Options{}, handler), keyed("k", "{}"))
		assert.Equal(t, http.StatusCreated, r.status, "the retry: %s", r.body)
	})

	// A claim that began a new operation ran nothing: the key is released
	// as rejected, and a corrected request (another body) takes it. One
	// that resumed an operation released as failed is released as failed
	// again: another body still gets 422.
	for _, resumed := range []bool{false, true} {
		t.Run(fmt.Sprintf("during the claim, resumed %v", resumed), func(t *testing.T) {
			mem := NewMemoryStore()
			handler := func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }
			if resumed { // a 500, not stored: released as failed
				failing := func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusInternalServerError) }
				require.Equal(t, http.StatusInternalServerError, serve(t, testHandler(t, mem, Options{}, failing), keyed("k", "{}")).status)
			}
			ctx, cancel := context.WithCancel(context.Background())
			opts := Options{Logger: testLogger(t)}
			h := withClient(Middleware(lateStore{mem, cancel}, opts)(http.HandlerFunc(handler)), opts)
			h.ServeHTTP(httptest.NewRecorder(), keyed("k", "{}").request(t, "").WithContext(ctx))
			want := http.StatusCreated
			if resumed {
				want = http.StatusUnprocessableEntity
			}
			r := serve(t, testHandler(t, mem, Options{}, handler), keyed("k", `{"other":1}`))
			assert.Equal(t, want, r.status, "another request after the claim its client left: %s", r.body)
		})
	}

	t.Run("handler answers nothing", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			var calls atomic.Int32
			h := testHandler(t, NewMemoryStore(), Options{}, func(w http.ResponseWriter, r *http.Request) {
				if calls.Add(1) == 1 {
					// The habit: give up when the context ends, and
					// write nothing.
					<-r.Context().Done()
					return
				}
				w.WriteHeader(http.StatusCreated)
			})
			mustNotRun(t, "handler that returned nothing after its deadline", serve(t, deadline(time.Second, h), keyed("k", "{}")))
			// Released as failed: the same request resumes, another one
			// gets 422.
			assert.Equal(t, http.StatusUnprocessableEntity, serve(t, h, keyed("k", `{"other":1}`)).status)
			r := serve(t, h, keyed("k", "{}"))
			assert.Equal(t, http.StatusCreated, r.status, "the retry: %s", r.body)
			assert.False(t, r.replayed())
			assert.Equal(t, int32(2), calls.Load())
		})
	})

	t.Run("handler answers after its deadline", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			var calls atomic.Int32
			h := testHandler(t, NewMemoryStore(), Options{}, func(w http.ResponseWriter, r *http.Request) {
				calls.Add(1)
				<-r.Context().Done()
				w.WriteHeader(http.StatusCreated) // the work was done: stored
			})
			assert.Equal(t, http.StatusCreated, serve(t, deadline(time.Second, h), keyed("k", "{}")).status)
			r := serve(t, h, keyed("k", "{}"))
			assert.True(t, r.replayed(), "the retry: %d %s", r.status, r.body)
			assert.Equal(t, int32(1), calls.Load())
		})
	})
}

// TestMiddlewareShutdown cancels the base context of a real server while
// requests are inside the middleware: a duplicate waiting for the first
// request and a first request whose handler gives up. None gets a 2xx.
func TestMiddlewareShutdown(t *testing.T) {
	base, shutdown := context.WithCancel(context.Background())
	defer shutdown()
	started := make(chan struct{})
	var calls atomic.Int32
	store := &recordingStore{Store: NewMemoryStore()}
	h := testHandler(t, store, Options{WaitForCompletion: time.Hour}, func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		close(started)
		<-r.Context().Done()
	})
	hs := httptest.NewUnstartedServer(h)
	hs.Config.BaseContext = func(net.Listener) context.Context { return base }
	hs.Start()
	defer hs.Close()
	ts := &testServer{URL: hs.URL, client: &http.Client{Transport: &http.Transport{}}}
	defer ts.client.CloseIdleConnections()

	first := make(chan reply)
	go func() { first <- ts.send(t, keyed("k", "{}")) }()
	<-started
	dup := make(chan reply)
	go func() { dup <- ts.send(t, keyed("k", "{}")) }()
	// The duplicate is waiting once it has claimed again after its first
	// wait: the first request's claim, then two of the duplicate's.
	for deadline := time.Now().Add(10 * time.Second); store.claimCount() < 3; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the duplicate did not wait for the first request")
		}
	}
	shutdown()
	mustNotRun(t, "in-flight request at shutdown", <-first)
	if r := <-dup; r.status != http.StatusConflict && r.status != http.StatusServiceUnavailable {
		t.Errorf("waiting duplicate at shutdown: %d %q, want 409 or 503", r.status, r.body)
	}
	assert.Equal(t, int32(1), calls.Load())
}

// recorded reads a recorded response.
func recorded(rec *httptest.ResponseRecorder) reply {
	resp := rec.Result()
	return reply{status: resp.StatusCode, header: resp.Header, body: rec.Body.Bytes()}
}

// TestMiddlewareClientIDInHandler: with Options.ClientID, the handler reads
// the client the key was scoped by with ClientIDFromContext, as it does
// behind an authentication middleware that calls WithClientID.
func TestMiddlewareClientIDInHandler(t *testing.T) {
	var got []string
	opts := Options{ClientID: func(r *http.Request) (string, bool) {
		return strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer "), true
	}}
	h := testHandler(t, NewMemoryStore(), opts, func(w http.ResponseWriter, r *http.Request) {
		id, ok := ClientIDFromContext(r.Context())
		if !ok {
			id = "(none)"
		}
		got = append(got, id)
		w.WriteHeader(http.StatusCreated)
	})
	for _, client := range []string{"tenant-a", "tenant-b"} {
		req := keyed("k", "{}").request(t, "")
		req.Header.Set("Authorization", "Bearer "+client)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		require.Equal(t, http.StatusCreated, rec.Code)
	}
	assert.Equal(t, []string{"tenant-a", "tenant-b"}, got)
}

// TestMiddlewareNested puts a Middleware behind another on one route, as a
// router group and the route would: the request runs once, is stored once
// and replayed, never answered 409 by the inner one; the mistake is logged
// once, at Error.
func TestMiddlewareNested(t *testing.T) {
	var logs bytes.Buffer
	opts := Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))}
	store := NewMemoryStore()
	var calls atomic.Int32
	inner := Middleware(store, opts)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		_, ok := ClaimFromContext(r.Context())
		assert.True(t, ok, "the handler has no claim")
		w.WriteHeader(http.StatusCreated)
	}))
	h := withClient(Middleware(store, Options{Logger: testLogger(t)})(inner), opts)
	for i, key := range []string{"k1", "k2", "k1"} {
		r := serve(t, h, keyed(key, "{}"))
		require.Equal(t, http.StatusCreated, r.status, "request %d: %s", i, r.body)
		assert.Equal(t, i == 2, r.replayed(), "request %d", i)
	}
	assert.Equal(t, int32(2), calls.Load())
	assert.Equal(t, 1, strings.Count(logs.String(), "applied twice"), "logs: %s", logs.String())
	assert.Contains(t, logs.String(), "level=ERROR")
}

// TestMiddlewareStatusAbove599: a status no store keeps (600 to 999, which
// net/http sends) is sent but not stored, also with StoreServerErrors, and
// the key is released as failed: the same request runs again, another one
// gets 422.
func TestMiddlewareStatusAbove599(t *testing.T) {
	for _, storeServerErrors := range []bool{false, true} {
		var calls atomic.Int32
		h := testHandler(t, NewMemoryStore(), Options{StoreServerErrors: storeServerErrors}, func(w http.ResponseWriter, r *http.Request) {
			if calls.Add(1) == 1 {
				w.WriteHeader(600)
				return
			}
			w.WriteHeader(http.StatusCreated)
		})
		assert.Equal(t, 600, serve(t, h, keyed("k", "{}")).status)
		assert.Equal(t, http.StatusUnprocessableEntity, serve(t, h, keyed("k", `{"a":1}`)).status)
		r := serve(t, h, keyed("k", "{}"))
		assert.Equal(t, http.StatusCreated, r.status)
		assert.False(t, r.replayed())
	}
}

// lateStore models a store whose claim commits but whose answer is lost
// because the request's context ended meanwhile, as pgx does when the
// context is cancelled while it waits for the claim's result: the claim
// happened, Claim returns the context's error.
type lateStore struct {
	Store
	cancel context.CancelFunc
}

func (s lateStore) Claim(ctx context.Context, req ClaimRequest) (ClaimResult, error) {
	res, err := s.Store.Claim(context.WithoutCancel(ctx), req)
	if err != nil {
		return res, err
	}
	s.cancel() // the client goes away while the answer travels back
	if err := ctx.Err(); err != nil {
		return ClaimResult{}, err // lost with the claim's context
	}
	return res, nil
}

// TestLostClaimAnswerLeavesKeyFree: the client disconnects while the claim is
// in flight; the claim committed. The key must not be left started (a
// retry would get 409 until the lease runs out, and forever with a
// negative LockTimeout).
func TestLostClaimAnswerLeavesKeyFree(t *testing.T) {
	for _, lt := range []time.Duration{0, -1} {
		t.Run(fmt.Sprint(lt), func(t *testing.T) {
			mem := NewMemoryStore()
			ctx, cancel := context.WithCancel(context.Background())
			var calls atomic.Int32
			opts := Options{LockTimeout: lt, Logger: testLogger(t)}
			handler := func(w http.ResponseWriter, r *http.Request) {
				calls.Add(1)
				w.WriteHeader(http.StatusCreated)
			}
			h := withClient(Middleware(lateStore{mem, cancel}, opts)(http.HandlerFunc(handler)), opts)
			req := keyed("k", "{}").request(t, "").WithContext(ctx)
			h.ServeHTTP(httptest.NewRecorder(), req)

			// The client's retry, on a healthy path.
			retry := serve(t, withClient(Middleware(mem, opts)(http.HandlerFunc(handler)), opts), keyed("k", "{}"))
			if retry.status != http.StatusCreated || calls.Load() != 1 {
				t.Errorf("retry after a lost claim answer: %d %s (handler ran %d times); want 201 at once",
					retry.status, retry.body, calls.Load())
			}
		})
	}
}
