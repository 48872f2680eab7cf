package idempotency

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestMiddlewareStatusPolicy checks which handler statuses are stored
// (replayed to the retry) and which release the key (the retry runs again).
func TestMiddlewareStatusPolicy(t *testing.T) {
	for _, storeServerErrors := range []bool{false, true} {
		for _, tt := range []struct {
			status int
			stored bool
		}{
			{200, true}, {201, true}, {204, true}, {303, true},
			{400, false}, {401, false}, {402, true}, {403, false}, {404, false},
			{409, false}, {410, true}, {422, true}, {429, false},
			{500, storeServerErrors}, {502, storeServerErrors}, {503, storeServerErrors},
		} {
			t.Run(fmt.Sprintf("%d/store5xx=%v", tt.status, storeServerErrors), func(t *testing.T) {
				var calls atomic.Int32
				ts := mwServer(t, NewMemoryStore(), Options{StoreServerErrors: storeServerErrors},
					func(w http.ResponseWriter, r *http.Request) {
						n := calls.Add(1)
						w.WriteHeader(tt.status)
						if tt.status != http.StatusNoContent {
							fmt.Fprintf(w, "call %d", n)
						}
					})
				first := ts.mustSend(t, keyed("k", "{}"))
				second := ts.mustSend(t, keyed("k", "{}"))
				if first.status != tt.status || second.status != tt.status {
					t.Fatalf("statuses %d, %d; want %d", first.status, second.status, tt.status)
				}
				if got := calls.Load() == 1; got != tt.stored {
					t.Errorf("handler ran %d times; stored = %v, want %v", calls.Load(), got, tt.stored)
				}
				if second.replayed() != tt.stored || (tt.stored && string(second.body) != string(first.body)) {
					t.Errorf("second answer replayed=%v %q, first %q", second.replayed(), second.body, first.body)
				}
			})
		}
	}
}

func TestMiddlewarePassesOtherMethods(t *testing.T) {
	for _, method := range []string{"GET", "HEAD", "PUT", "DELETE", "OPTIONS"} {
		var sawTx bool
		ts := mwServer(t, NewMemoryStore(), Options{ClientID: func(*http.Request) (string, bool) { return "", false }},
			func(w http.ResponseWriter, r *http.Request) {
				_, sawTx = TxFromContext(r.Context())
				w.WriteHeader(http.StatusTeapot)
			})
		r := ts.mustSend(t, call{method: method})
		if r.status != http.StatusTeapot || sawTx || r.header.Get("Idempotency-Key") != "" {
			t.Errorf("%s: %d tx=%v, want the handler's 418 untouched", method, r.status, sawTx)
		}
	}
}

// TestMiddlewareReplayHeaders checks what a replay carries: the stored
// status, content type, headers (those Options.StoredHeaders lists) and
// body, not cookies.
func TestMiddlewareReplayHeaders(t *testing.T) {
	var calls atomic.Int32
	opts := Options{StoredHeaders: append(DefaultStoredHeaders(), "X-Multi", "Set-Cookie")}
	ts := mwServer(t, NewMemoryStore(), opts, func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		claim, ok := ClaimFromContext(r.Context())
		if !ok || claim.ClientID != "c" || claim.Key != "k" || claim.OperationID == "" {
			t.Errorf("claim in context: %+v %v", claim, ok)
		}
		if b, _ := io.ReadAll(r.Body); string(b) != `{"b": 1}` {
			t.Errorf("handler read body %q", b)
		}
		h := w.Header()
		h.Set("Location", "/things/1")
		h.Add("X-Multi", "a")
		h.Add("X-Multi", "b")
		h.Set("Set-Cookie", "session=1")
		h.Set("Content-Type", "text/csv")
		w.WriteHeader(http.StatusAccepted)
		io.WriteString(w, "a,b\n1,2\n")
	})
	first := ts.mustSend(t, keyed("k", `{"b": 1}`))
	again := ts.mustSend(t, keyed("k", `{"b":1}`))
	if calls.Load() != 1 || again.status != http.StatusAccepted || string(again.body) != "a,b\n1,2\n" || !again.replayed() {
		t.Fatalf("replay %d %q replayed=%v after %d calls", again.status, again.body, again.replayed(), calls.Load())
	}
	for h, want := range map[string]string{
		"Content-Type": "text/csv", "Location": "/things/1", "X-Multi": "a, b",
		"Set-Cookie": "", "Idempotency-Key": "k", "Content-Length": "8",
	} {
		if got := again.header.Get(h); got != want {
			t.Errorf("replayed %s = %q, want %q", h, got, want)
		}
	}
	if first.header.Get("Set-Cookie") == "" || first.replayed() {
		t.Error("the first answer lost its cookie or says it is replayed")
	}
}

// TestMiddlewareOtherRequestSameKey checks that the method, path, query and
// body are all part of the request a key belongs to.
func TestMiddlewareOtherRequestSameKey(t *testing.T) {
	ts := mwServer(t, NewMemoryStore(), Options{}, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	})
	if r := ts.mustSend(t, keyed("k", `{"a": 1}`)); r.status != http.StatusCreated {
		t.Fatalf("first: %d", r.status)
	}
	for _, c := range []call{
		{method: "PATCH", keys: []string{"k"}, body: `{"a": 1}`},
		{path: "/v1/refunds", keys: []string{"k"}, body: `{"a": 1}`},
		{path: "/v1/payments?expand=x", keys: []string{"k"}, body: `{"a": 1}`},
		{keys: []string{"k"}, body: `{"a": 2}`},
		{keys: []string{"k"}},
	} {
		r := ts.mustSend(t, c)
		if r.status != http.StatusUnprocessableEntity || r.problem(t).Type != ProblemKeyMismatch {
			t.Errorf("%s %s %q: %d, want 422", c.method, c.path, c.body, r.status)
		}
	}
}

func TestMiddlewareEmptyResponseSniffed(t *testing.T) {
	ts := mwServer(t, NewMemoryStore(), Options{}, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/html" {
			io.WriteString(w, "<html>hi</html>")
		}
	})
	for _, path := range []string{"/empty", "/html"} {
		first := ts.mustSend(t, call{path: path, keys: []string{"k" + path}})
		again := ts.mustSend(t, call{path: path, keys: []string{"k" + path}})
		if first.status != 200 || !again.replayed() || again.header.Get("Content-Type") != first.header.Get("Content-Type") {
			t.Errorf("%s: %d, replay %v with Content-Type %q, first %q", path, first.status, again.replayed(),
				again.header.Get("Content-Type"), first.header.Get("Content-Type"))
		}
	}
}

// TestMiddlewarePanic checks that a panicking handler's key is released:
// the retry runs again at once, under the same operation.
func TestMiddlewarePanic(t *testing.T) {
	var mu sync.Mutex
	var ops []string
	ts := mwServer(t, NewMemoryStore(), Options{}, func(w http.ResponseWriter, r *http.Request) {
		c, _ := ClaimFromContext(r.Context())
		mu.Lock()
		ops = append(ops, c.OperationID)
		n := len(ops)
		mu.Unlock()
		if n == 1 {
			panic(http.ErrAbortHandler)
		}
		w.WriteHeader(http.StatusCreated)
	})
	if r := ts.send(t, keyed("k", "{}")); r.err == nil {
		t.Fatalf("panicking handler answered %d", r.status)
	}
	if r := ts.mustSend(t, keyed("k", "{}")); r.status != http.StatusCreated || r.replayed() {
		t.Errorf("retry: %d replayed=%v, want a fresh 201", r.status, r.replayed())
	}
	mu.Lock()
	defer mu.Unlock()
	if len(ops) != 2 || ops[0] == "" || ops[0] != ops[1] {
		t.Errorf("operations %q, want the same one twice", ops)
	}
}

// TestMiddlewareReleaseKeepsOperation checks what a released key gives the
// next request: the retry of the same request runs at once (no 409) under
// the same operation, so work keyed by it downstream is found; a corrected
// request is a new operation.
func TestMiddlewareReleaseKeepsOperation(t *testing.T) {
	var mu sync.Mutex
	charged := map[string]int{} // a downstream system keyed by the operation
	var ops []string
	seen := func() ([]string, int) {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(ops), len(charged)
	}
	ts := mwServer(t, NewMemoryStore(), Options{}, func(w http.ResponseWriter, r *http.Request) {
		c, _ := ClaimFromContext(r.Context())
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		ops = append(ops, c.OperationID)
		n := len(ops)
		mu.Unlock()
		if string(body) == `{"bad": true}` {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		mu.Lock()
		charged[c.OperationID]++ // irreversible, but keyed
		mu.Unlock()
		if n == 1 {
			w.WriteHeader(http.StatusServiceUnavailable) // fails after the charge
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	if r := ts.mustSend(t, keyed("k", `{"a": 1}`)); r.status != http.StatusServiceUnavailable {
		t.Fatalf("first: %d, want 503", r.status)
	}
	if r := ts.mustSend(t, keyed("k", `{"a": 1}`)); r.status != http.StatusCreated || r.replayed() {
		t.Fatalf("retry: %d replayed=%v, want a fresh 201 at once", r.status, r.replayed())
	}
	if ops, charges := seen(); len(ops) != 2 || ops[0] != ops[1] || charges != 1 {
		t.Errorf("operations %q, %d charged; want one operation for both attempts", ops, charges)
	}

	// A 400 releases the key; the corrected request is a new operation.
	if r := ts.mustSend(t, keyed("k2", `{"bad": true}`)); r.status != http.StatusBadRequest {
		t.Fatalf("bad request: %d", r.status)
	}
	if r := ts.mustSend(t, keyed("k2", `{"a": 2}`)); r.status != http.StatusCreated || r.replayed() {
		t.Fatalf("corrected request: %d replayed=%v, want a fresh 201", r.status, r.replayed())
	}
	if ops, _ := seen(); len(ops) != 4 || ops[2] == ops[3] || ops[2] == ops[0] {
		t.Errorf("operations %q: want the corrected request under a new operation", ops)
	}
	// The released-then-replaced key now belongs to the corrected request.
	if r := ts.mustSend(t, keyed("k2", `{"bad": true}`)); r.status != http.StatusUnprocessableEntity {
		t.Errorf("the bad body again: %d, want 422", r.status)
	}
}

// TestMiddlewareClientGone checks that a handler that finishes after its
// client went away is completed, so the retry gets the replay.
func TestMiddlewareClientGone(t *testing.T) {
	entered, finish := make(chan struct{}), make(chan struct{})
	var calls atomic.Int32
	ts := mwServer(t, NewMemoryStore(), Options{}, func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			close(entered)
			<-finish
		}
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "done")
	})
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, "POST", ts.URL+"/v1/payments", strings.NewReader("{}"))
		req.Header.Set("Idempotency-Key", "k")
		req.Header.Set("Content-Type", "application/json")
		resp, err := ts.client.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		errc <- err
	}()
	<-entered
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("client: %v", err)
	}
	close(finish)
	// Until the first request's handler has returned, the key is started.
	r := ts.mustSend(t, keyed("k", "{}"))
	for i := 0; r.status == http.StatusConflict && i < 500; i++ {
		time.Sleep(10 * time.Millisecond)
		r = ts.mustSend(t, keyed("k", "{}"))
	}
	if r.status != http.StatusCreated || !r.replayed() || calls.Load() != 1 {
		t.Errorf("retry: %d replayed=%v after %d calls; want the stored outcome", r.status, r.replayed(), calls.Load())
	}
}

func TestOptions(t *testing.T) {
	ok := func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }
	t.Run("KeyHeader", func(t *testing.T) {
		ts := mwServer(t, NewMemoryStore(), Options{KeyHeader: "x-request-key"}, ok)
		r := ts.mustSend(t, keyed("k", "{}"))
		if r.status != http.StatusBadRequest || !strings.Contains(r.problem(t).Detail, "X-Request-Key") {
			t.Errorf("without the custom header: %d %s", r.status, r.body)
		}
		req, _ := http.NewRequest("POST", ts.URL, strings.NewReader("{}"))
		req.Header.Set("X-Request-Key", "k")
		resp, err := ts.client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated || resp.Header.Get("X-Request-Key") != "k" {
			t.Errorf("with the custom header: %d, echo %q", resp.StatusCode, resp.Header.Get("X-Request-Key"))
		}
	})
	t.Run("ClientID", func(t *testing.T) {
		ts := mwServer(t, NewMemoryStore(), Options{ClientID: func(r *http.Request) (string, bool) {
			id := r.Header.Get("X-Tenant")
			return id, id != ""
		}}, ok)
		r := ts.mustSend(t, keyed("k", "{}"))
		if r.status != http.StatusUnauthorized || r.problem(t).Type != ProblemUnauthorized {
			t.Errorf("no tenant: %d", r.status)
		}
	})
	t.Run("RetryAfter", func(t *testing.T) {
		store := NewMemoryStore()
		ts := mwServer(t, store, Options{RetryAfter: 1500 * time.Millisecond}, ok)
		fp, _ := Fingerprint("POST", "/v1/payments", "", "application/json", []byte("{}"))
		store.Claim(context.Background(), ClaimRequest{ClientID: "c", Key: "k", Method: "POST", Path: "/v1/payments", Fingerprint: fp})
		r := ts.mustSend(t, keyed("k", "{}"))
		if r.status != http.StatusConflict || r.header.Get("Retry-After") != "2" {
			t.Errorf("%d Retry-After %q, want 409 and 2", r.status, r.header.Get("Retry-After"))
		}
	})
	t.Run("NoLockTimeout", func(t *testing.T) {
		store, clock := newClockedMemoryStore()
		rec := &recordingStore{Store: store}
		ts := mwServer(t, rec, Options{LockTimeout: -1}, ok)
		fp, _ := Fingerprint("POST", "/v1/payments", "", "application/json", []byte("{}"))
		store.Claim(context.Background(), ClaimRequest{ClientID: "c", Key: "k", Method: "POST", Path: "/v1/payments", Fingerprint: fp})
		clock.Advance(time.Hour)
		if r := ts.mustSend(t, keyed("k", "{}")); r.status != http.StatusConflict {
			t.Errorf("stale key without lock timeout: %d, want 409", r.status)
		}
		if r := ts.mustSend(t, keyed("k2", "{}")); r.status != http.StatusCreated {
			t.Errorf("new key: %d, want 201", r.status)
		}
		if got := rec.requests(); len(got) != 2 || got[1].LockTimeout != 0 {
			t.Errorf("claims %+v, want the second with no lease (LockTimeout 0)", got)
		}
	})
	t.Run("UnlimitedBody", func(t *testing.T) {
		ts := mwServer(t, NewMemoryStore(), Options{MaxBodyBytes: -1}, ok)
		big := `{"x": "` + strings.Repeat("y", 2<<20) + `"}`
		if r := ts.mustSend(t, keyed("k", big)); r.status != http.StatusCreated {
			t.Errorf("2 MiB body without a limit: %d", r.status)
		}
	})
}

// failingStore fails the operations named in fail.
type failingStore struct {
	*MemoryStore
	fail string
}

var errBroken = errors.New("store is broken")

func (s *failingStore) Claim(ctx context.Context, req ClaimRequest) (ClaimResult, error) {
	if s.fail == "claim" {
		return ClaimResult{}, errBroken
	}
	return s.MemoryStore.Claim(ctx, req)
}

func (s *failingStore) Begin(ctx context.Context, c Claim) (Tx, error) {
	if s.fail == "begin" {
		return nil, errBroken
	}
	tx, err := s.MemoryStore.Begin(ctx, c)
	if s.fail == "complete" {
		return failingTx{tx}, err
	}
	return tx, err
}

type failingTx struct{ Tx }

func (failingTx) Complete(context.Context, StoredResponse) error { return errBroken }

func TestMiddlewareStoreErrors(t *testing.T) {
	for _, fail := range []string{"claim", "begin", "complete"} {
		t.Run(fail, func(t *testing.T) {
			store := &failingStore{MemoryStore: NewMemoryStore(), fail: fail}
			ts := mwServer(t, store, Options{}, func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(http.StatusCreated)
			})
			r := ts.mustSend(t, keyed("k", "{}"))
			if r.status != http.StatusInternalServerError || r.problem(t).Type != ProblemInternal {
				t.Fatalf("%d %s, want 500 internal", r.status, r.body)
			}
			// The key was released: with the store fixed, the retry runs.
			store.fail = ""
			if r := ts.mustSend(t, keyed("k", "{}")); r.status != http.StatusCreated || r.replayed() {
				t.Errorf("retry: %d replayed=%v", r.status, r.replayed())
			}
		})
	}
}

func TestContextAccessorsOutsideRequests(t *testing.T) {
	ctx := context.Background()
	if _, ok := TxFromContext(ctx); ok {
		t.Error("TxFromContext found a Tx")
	}
	if _, ok := ClaimFromContext(ctx); ok {
		t.Error("ClaimFromContext found a Claim")
	}
	if _, ok := ClientIDFromContext(ctx); ok {
		t.Error("ClientIDFromContext found a client")
	}
	if got := EventTookOver.String(); got != "took_over" {
		t.Errorf("EventTookOver = %q", got)
	}
	if got := Event(99).String(); got != "event(99)" {
		t.Errorf("Event(99) = %q", got)
	}
}

// TestMiddlewareInvalidPath sends paths that are not valid text (a NUL, a
// byte that is not UTF-8): 400 before the key is claimed, so nothing is
// stored and the handler does not run.
func TestMiddlewareInvalidPath(t *testing.T) {
	for _, path := range []string{"/v1/a%00b", "/v1/caf%E9", "/v1/%ED%A0%80"} {
		store := &recordingStore{Store: NewMemoryStore()}
		var ev events
		called := false
		h := testHandler(t, store, Options{OnEvent: ev.add}, func(w http.ResponseWriter, r *http.Request) { called = true })
		r := serve(t, h, call{path: path, keys: []string{"k"}, body: "{}"})
		if r.status != http.StatusBadRequest || r.problem(t).Type != ProblemInvalidRequest {
			t.Errorf("%s: %d %s, want 400 invalid-request", path, r.status, r.body)
		}
		if called || len(store.requests()) != 0 || ev.count(EventRejected) != 1 {
			t.Errorf("%s: handler called %v, %d claims, %d rejected events; want false, 0, 1",
				path, called, len(store.requests()), ev.count(EventRejected))
		}
		if got := r.header.Get("Idempotency-Key"); got != "k" {
			t.Errorf("%s: echoed key %q, want k", path, got)
		}
	}
}

// TestMiddlewareInvalidClientID is a ClientID hook that returns text no
// store keeps: a 500 that names no key, and nothing claimed.
func TestMiddlewareInvalidClientID(t *testing.T) {
	store := &recordingStore{Store: NewMemoryStore()}
	h := testHandler(t, store, Options{ClientID: func(*http.Request) (string, bool) { return "tenant\x00", true }},
		func(w http.ResponseWriter, r *http.Request) { t.Error("handler called") })
	r := serve(t, h, keyed("k", "{}"))
	if r.status != http.StatusInternalServerError || r.problem(t).Type != ProblemInternal {
		t.Errorf("%d %s, want 500 internal", r.status, r.body)
	}
	if n := len(store.requests()); n != 0 {
		t.Errorf("%d claims, want none", n)
	}
}

// TestMiddlewareUnstorableResponse has a handler answer a header the store
// cannot keep: the outcome is stored without it (failing the completion
// would fail the operation on every retry of a handler that answers the
// same header, after its work was done), the first response carries it,
// and the retry gets the replay without it.
func TestMiddlewareUnstorableResponse(t *testing.T) {
	mem := NewMemoryStore()
	var rows journal
	var calls atomic.Int32
	h := testHandler(t, mem, Options{StoredHeaders: []string{"Location", "X-Ok"}}, func(w http.ResponseWriter, r *http.Request) {
		n := calls.Add(1)
		mem.Stage(r.Context(), func() error { rows.add(fmt.Sprint(n)); return nil })
		w.Header().Set("Location", "/v1/caf\xe9")
		w.Header().Set("X-Ok", "yes")
		w.WriteHeader(http.StatusCreated)
	})
	if r := serve(t, h, keyed("k", "{}")); r.status != http.StatusCreated || r.header.Get("Location") != "/v1/caf\xe9" {
		t.Errorf("unstorable header: %d %s Location %q, want 201 with the header", r.status, r.body, r.header.Get("Location"))
	}
	r := serve(t, h, keyed("k", "{}"))
	if r.status != http.StatusCreated || !r.replayed() || r.header.Get("X-Ok") != "yes" || r.header.Values("Location") != nil {
		t.Errorf("retry: %d replayed=%v header %v, want the replay with X-Ok and without Location", r.status, r.replayed(), r.header)
	}
	if got := rows.list(); !slices.Equal(got, []string{"1"}) {
		t.Errorf("rows %q, want only the first request's", got)
	}
}

// TestMiddlewareClaimOptions checks the lease and retention the middleware
// stores with each key: the defaults, the options given, and none for a
// negative option; the caller's Options are not changed.
func TestMiddlewareClaimOptions(t *testing.T) {
	for _, tt := range []struct {
		opts                 Options
		lockTimeout, keepFor time.Duration
	}{
		{Options{}, DefaultLockTimeout, DefaultRetention},
		{Options{LockTimeout: 2 * time.Second, Retention: time.Minute}, 2 * time.Second, time.Minute},
		{Options{LockTimeout: -1, Retention: -1}, 0, 0},
	} {
		store := &recordingStore{Store: NewMemoryStore()}
		opts := tt.opts
		h := testHandler(t, store, opts, func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) })
		serve(t, h, keyed("k", "{}"))
		got := store.requests()
		if len(got) != 1 || got[0].LockTimeout != tt.lockTimeout || got[0].Retention != tt.keepFor {
			t.Errorf("Options%+v: claims %+v, want lease %v and retention %v", tt.opts, got, tt.lockTimeout, tt.keepFor)
		}
		if got[0].ClientID != "c" || got[0].Key != "k" || got[0].Method != "POST" || got[0].Path != "/v1/payments" {
			t.Errorf("claim names %+v", got[0])
		}
		if opts.LockTimeout != tt.opts.LockTimeout || opts.Retention != tt.opts.Retention || opts.Logger != nil {
			t.Errorf("the caller's Options changed: %+v", opts)
		}
	}
	if DefaultLockTimeout != 10*time.Second {
		t.Errorf("DefaultLockTimeout = %v, want 10s", DefaultLockTimeout)
	}
}

// TestMiddlewareWaitForCompletion holds a duplicate while the first
// request runs: it gets the first one's outcome as a replay, not a 409;
// and a duplicate that waits longer than WaitForCompletion gets the 409.
func TestMiddlewareWaitForCompletion(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var calls atomic.Int32
		h := testHandler(t, NewMemoryStore(), Options{WaitForCompletion: 2 * time.Second}, func(w http.ResponseWriter, r *http.Request) {
			calls.Add(1)
			time.Sleep(time.Second)
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, "done")
		})
		first := make(chan reply)
		go func() { first <- serve(t, h, keyed("k", "{}")) }()
		synctest.Wait()
		if r := serve(t, h, keyed("k", "{}")); r.status != http.StatusCreated || !r.replayed() || string(r.body) != "done" {
			t.Errorf("waiting duplicate: %d %q replayed=%v, want the replay", r.status, r.body, r.replayed())
		}
		<-first

		slow := testHandler(t, NewMemoryStore(), Options{WaitForCompletion: time.Second}, func(w http.ResponseWriter, r *http.Request) {
			time.Sleep(5 * time.Second)
			w.WriteHeader(http.StatusCreated)
		})
		go func() { first <- serve(t, slow, keyed("k", "{}")) }()
		synctest.Wait()
		if r := serve(t, slow, keyed("k", "{}")); r.status != http.StatusConflict || r.header.Get("Retry-After") == "" {
			t.Errorf("duplicate past WaitForCompletion: %d, Retry-After %q; want 409 with Retry-After", r.status, r.header.Get("Retry-After"))
		}
		<-first
		if n := calls.Load(); n != 1 {
			t.Errorf("handler ran %d times, want 1", n)
		}
	})
}

// TestValidateRefusesBeforeTheClaim: a request that Options.Validate
// refuses gets its answer and leaves its key unused, so the corrected
// request with the key runs, and a late copy of the refused one, which
// arrives after it, is refused again instead of taking the key from it.
func TestValidateRefusesBeforeTheClaim(t *testing.T) {
	var calls atomic.Int32
	store := NewMemoryStore()
	opts := Options{Validate: func(w http.ResponseWriter, r *http.Request) bool {
		b, _ := io.ReadAll(r.Body)
		if strings.Contains(string(b), "bad") {
			http.Error(w, "bad field", http.StatusBadRequest)
			return false
		}
		return true
	}}
	ts := mwServer(t, store, opts, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		calls.Add(1)
		w.WriteHeader(http.StatusCreated)
		w.Write(b)
	})
	if r := ts.mustSend(t, keyed("k", `{"bad":1}`)); r.status != http.StatusBadRequest {
		t.Fatalf("refused request: %d %s", r.status, r.body)
	}
	if res, err := store.Claim(context.Background(), ClaimRequest{ClientID: "c", Key: "k", Method: "POST", Path: "/v1/payments",
		Fingerprint: []byte("probe")}); err != nil || res.Outcome != Claimed {
		t.Fatalf("the key after a refusal: %+v, %v; want it unused", res, err)
	} else {
		require.NoError(t, store.Release(context.Background(), res.Claim, ReleaseRejected))
	}
	corrected := ts.mustSend(t, keyed("k", `{"good":1}`))
	require.Equal(t, http.StatusCreated, corrected.status, "corrected request: %s", corrected.body)
	late := ts.mustSend(t, keyed("k", `{"bad":1}`))
	assert.Equal(t, http.StatusBadRequest, late.status, "a late copy of the refused request: %s", late.body)
	again := ts.mustSend(t, keyed("k", `{"good":1}`))
	assert.True(t, again.replayed(), "the corrected request again: %d %s", again.status, again.body)
	assert.Equal(t, `{"good":1}`, string(again.body), "the handler saw the body after Validate read it")
	assert.Equal(t, int32(1), calls.Load())
}

// TestNewRefusesOptionsThatCannotWork checks that New returns an error,
// and Middleware panics with it, for a store or options it cannot serve
// with; the zero Options work.
func TestNewRefusesOptionsThatCannotWork(t *testing.T) {
	cases := map[string]struct {
		store Store
		opts  Options
		want  string
	}{
		"nil store":      {nil, Options{}, "idempotency: the Store is nil"},
		"unknown format": {NewMemoryStore(), Options{BodyFormat: 9}, "idempotency: Options.BodyFormat 9 is not a format this package knows"},
		"negative skew":  {NewMemoryStore(), Options{FirstSentSkew: -time.Second}, "idempotency: Options.FirstSentSkew -1s must be positive and less than half the Retention (24h0m0s)"},
		"skew of half":   {NewMemoryStore(), Options{Retention: time.Hour, FirstSentSkew: 30 * time.Minute}, "idempotency: Options.FirstSentSkew 30m0s must be positive and less than half the Retention (1h0m0s)"},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			mw, err := New(c.store, c.opts)
			assert.Nil(t, mw)
			assert.EqualError(t, err, c.want)
			assert.PanicsWithError(t, c.want, func() { Middleware(c.store, c.opts) })
		})
	}
	mw, err := New(NewMemoryStore(), Options{})
	require.NoError(t, err)
	assert.NotNil(t, mw)
}
