package idempotency

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"
)

// TestHostileEchoedObsTextHeader: a handler that echoes a request header
// (a correlation id) whose value holds obs-text bytes, which net/http
// accepts, answers 201. The operation must complete once and be replayed.
func TestHostileEchoedObsTextHeader(t *testing.T) {
	var calls atomic.Int32
	ts := mwServer(t, NewMemoryStore(), Options{}, func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		w.Header().Set("X-Correlation-Id", r.Header.Get("X-Correlation-Id"))
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"call":%d}`, calls.Load())
	})
	send := func() reply {
		req := keyed("k", "{}").request(t, ts.URL)
		req.Header.Set("X-Correlation-Id", "caf\xe9")
		resp, err := ts.client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var b [256]byte
		n, _ := resp.Body.Read(b[:])
		return reply{status: resp.StatusCode, header: resp.Header, body: b[:n]}
	}
	first := send()
	second := send()
	if first.status != http.StatusCreated || second.status != http.StatusCreated || !second.replayed() || calls.Load() != 1 {
		t.Errorf("first %d %s, second %d replayed=%v %s, handler ran %d times; want 201, then its replay, one run",
			first.status, first.body, second.status, second.replayed(), second.body, calls.Load())
	}
}

// TestHostileInvalidStatus: a handler that writes a status net/http
// refuses (WriteHeader panics on codes outside 100-999). The recorder must
// not store an outcome that can never be sent.
func TestHostileInvalidStatus(t *testing.T) {
	for _, code := range []int{0, 42, 1000} {
		t.Run(fmt.Sprint(code), func(t *testing.T) {
			store := NewMemoryStore()
			h := testHandler(t, store, Options{StoreServerErrors: true}, func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(code)
				w.Write([]byte("ok"))
			})
			func() {
				defer func() { recover() }()
				serve(t, h, keyed("k", "{}"))
			}()
			res, err := store.Claim(context.Background(), ClaimRequest{ClientID: "c", Key: "k", Method: "POST", Path: "/v1/payments",
				Fingerprint: mustFingerprint(t, "POST", "/v1/payments", "", "application/json", "{}"), LockTimeout: DefaultLockTimeout})
			if err != nil {
				t.Fatal(err)
			}
			if res.Outcome == Exists && res.Record.Status == StatusCompleted {
				t.Errorf("WriteHeader(%d), which net/http refuses with a panic, stored as the key's outcome %d", code, res.Record.Response.Status)
			}
		})
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

// TestHostileClaimAnswerLost: the client disconnects while the claim is
// in flight; the claim committed. The key must not be left started (a
// retry would get 409 until the lease runs out, and forever with a
// negative LockTimeout).
func TestHostileClaimAnswerLost(t *testing.T) {
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

// TestHostileContentTypeSuppressed: a handler that suppresses the
// Content-Type (net/http's documented nil value) gets none on its first
// response; the replay must not get a sniffed one.
func TestHostileContentTypeSuppressed(t *testing.T) {
	ts := mwServer(t, NewMemoryStore(), Options{}, func(w http.ResponseWriter, r *http.Request) {
		w.Header()["Content-Type"] = nil
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte("<html>created</html>"))
	})
	first := ts.mustSend(t, keyed("k", "{}"))
	second := ts.mustSend(t, keyed("k", "{}"))
	if !second.replayed() || first.header.Get("Content-Type") != second.header.Get("Content-Type") {
		t.Errorf("Content-Type of first %q, of replay %q (replayed=%v); want the same",
			first.header.Get("Content-Type"), second.header.Get("Content-Type"), second.replayed())
	}
}

// TestHostileTakeOverThenBeginFails: a request claims a key, charges a
// card under its operation and dies; its retry takes the key over, but
// Begin fails (the client went away, the store hiccupped). The key must
// still belong to that operation: another request with the key is a
// mismatch, not a new operation that orphans the charge.
func TestHostileTakeOverThenBeginFails(t *testing.T) {
	mem := NewMemoryStore()
	store := &failingStore{MemoryStore: mem}
	var ops []string
	ts := mwServer(t, store, Options{LockTimeout: time.Millisecond}, func(w http.ResponseWriter, r *http.Request) {
		c, _ := ClaimFromContext(r.Context())
		ops = append(ops, c.OperationID)
		w.WriteHeader(http.StatusCreated)
	})
	// The first request: claimed, charged under its operation, crashed.
	first, err := mem.Claim(context.Background(), ClaimRequest{ClientID: "c", Key: "k", Method: "POST", Path: "/v1/payments",
		Fingerprint: mustFingerprint(t, "POST", "/v1/payments", "", "application/json", `{"amount":100}`),
		LockTimeout: time.Millisecond, Retention: time.Hour})
	if err != nil || first.Outcome != Claimed {
		t.Fatal(first, err)
	}
	time.Sleep(10 * time.Millisecond)
	store.fail = "begin"
	if r := ts.mustSend(t, keyed("k", `{"amount":100}`)); r.status != http.StatusInternalServerError {
		t.Fatalf("retry with a failing Begin: %d", r.status)
	}
	store.fail = ""
	// Another request with the key.
	r := ts.mustSend(t, keyed("k", `{"amount":9999}`))
	if r.status != http.StatusUnprocessableEntity {
		t.Errorf("another request with the key of a taken-over operation: %d (operations run %v); want 422, operation %s is not finished",
			r.status, ops, first.Claim.OperationID)
	}
}
