package server

import (
	"context"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/storetest"
)

// storages are the key stores the stored-response tests run on: in
// memory, and on PostgreSQL in a schema of the test's own.
var storages = []struct {
	name       string
	newStorage newStorageFunc
}{
	{"memory", memoryStorage},
	{"postgres", postgresStorage},
}

// serveKeyed serves h behind idempotency.Middleware on keys with opts,
// every request authenticated as client "c", until the test ends, and
// returns a function that POSTs body with the key and returns the answer.
func serveKeyed(t *testing.T, keys idempotency.Store, opts idempotency.Options, h http.HandlerFunc) func(key, body string) (*http.Response, string) {
	t.Helper()
	if opts.Logger == nil {
		opts.Logger = testLogger(t)
	}
	mw := idempotency.Middleware(keys, opts)(h)
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mw.ServeHTTP(w, r.WithContext(idempotency.WithClientID(r.Context(), "c")))
	}))
	tr := &http.Transport{}
	t.Cleanup(func() {
		tr.CloseIdleConnections()
		hs.Close()
	})
	return func(key, body string) (*http.Response, string) {
		t.Helper()
		req, err := http.NewRequest("POST", hs.URL+"/v1/things", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		resp, err := tr.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return resp, string(b)
	}
}

// TestReplayOwnMediaTypeLikeSealed: a handler's own media type that begins
// like the sealed one (application/vnd.idemkit.sealedreport+json) is not
// sealed: on a server that never seals, its replays are its 201, not 500.
func TestReplayOwnMediaTypeLikeSealed(t *testing.T) {
	const ct = "application/vnd.idemkit.sealedreport+json"
	for _, st := range storages {
		t.Run(st.name, func(t *testing.T) {
			post := serveKeyed(t, st.newStorage(t).Keys, idempotency.Options{}, func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", ct)
				w.WriteHeader(http.StatusCreated)
				io.WriteString(w, `{"report":"r_1"}`)
			})
			first, firstBody := post("k-report", `{}`)
			for i := range 2 {
				again, body := post("k-report", `{}`)
				if again.StatusCode != http.StatusCreated || body != firstBody || again.Header.Get("Content-Type") != ct ||
					again.Header.Get("Idempotent-Replayed") != "true" {
					t.Errorf("replay %d: %d %s %q, want the first answer %d %s %q", i+1, again.StatusCode, again.Header.Get("Content-Type"), body,
						first.StatusCode, first.Header.Get("Content-Type"), firstBody)
				}
			}
		})
	}
}

// credentialHeaders are headers no replay may carry, with the values a
// hostile or careless row holds: another client's session and token, and
// another request's key.
var credentialHeaders = map[string]string{
	"Set-Cookie":       "session=someone-elses",
	"Authorization":    "Bearer someone-elses",
	"Www-Authenticate": `Bearer realm="x"`,
	"Idempotency-Key":  "someone-elses-key",
	"Location":         "/v1/things/t_1",
}

// mustReplayNoCredential checks a replay of the key k: the stored 201 and
// its Location, no credential, and the key echoed as the request sent it.
func mustReplayNoCredential(t *testing.T, resp *http.Response, body, key string) {
	t.Helper()
	if resp.StatusCode != http.StatusCreated || resp.Header.Get("Idempotent-Replayed") != "true" || body != `{"id":"t_1"}` {
		t.Fatalf("replay: %d %v %s, want the stored 201", resp.StatusCode, resp.Header, body)
	}
	for _, h := range []string{"Set-Cookie", "Authorization", "Www-Authenticate"} {
		if v := resp.Header.Values(h); len(v) > 0 {
			t.Errorf("the replay carries %s: %q", h, v)
		}
	}
	if got := resp.Header.Values("Idempotency-Key"); len(got) != 1 || got[0] != key {
		t.Errorf("the replay echoes Idempotency-Key %q, want %q, as the request sent it", got, key)
	}
	if got := resp.Header.Get("Location"); got != "/v1/things/t_1" {
		t.Errorf("the replay's Location %q, want the stored one", got)
	}
}

// TestReplayWritesNoCredentialHeader: a row that holds credential headers
// and another request's key (written by an older release, a hook, or
// whoever can write the store) replays none of them: the key is echoed as
// the request sent it.
func TestReplayWritesNoCredentialHeader(t *testing.T) {
	for _, st := range storages {
		t.Run(st.name, func(t *testing.T) {
			keys := st.newStorage(t).Keys
			var calls int
			post := serveKeyed(t, keys, idempotency.Options{}, func(w http.ResponseWriter, r *http.Request) {
				calls++
				w.WriteHeader(http.StatusInternalServerError) // released, as failed
			})
			if resp, _ := post("k-row", `{}`); resp.StatusCode != http.StatusInternalServerError {
				t.Fatalf("first: %d", resp.StatusCode)
			}
			// Complete the released key behind the middleware's back, as
			// the same request would claim it.
			fp, err := idempotency.Fingerprint("POST", "/v1/things", "", "application/json", []byte(`{}`))
			if err != nil {
				t.Fatal(err)
			}
			ctx := context.Background()
			res, err := keys.Claim(ctx, idempotency.ClaimRequest{ClientID: "c", Key: "k-row", Method: "POST", Path: "/v1/things",
				Fingerprint: fp, Retention: time.Hour})
			if err != nil || res.Outcome != idempotency.Claimed {
				t.Fatalf("Claim = %+v, %v", res, err)
			}
			tx, err := keys.Begin(ctx, res.Claim)
			if err != nil {
				t.Fatal(err)
			}
			if err := tx.Complete(ctx, idempotency.StoredResponse{Status: http.StatusCreated, ContentType: "application/json",
				Header: credentialHeaders, Body: []byte(`{"id":"t_1"}`)}); err != nil {
				t.Fatal(err)
			}
			resp, body := post("k-row", `{}`)
			mustReplayNoCredential(t, resp, body, "k-row")
			if calls != 1 {
				t.Errorf("the handler ran %d times, want 1", calls)
			}
		})
	}
}

// releasedKey serves a handler that answers 500 (the key released as
// failed, abandoned at once for a sweeper of no grace) to the first
// request with key, and 201 after; it returns the post function and the
// number of runs so far.
func releasedKey(t *testing.T, keys idempotency.Store, key string) (func(key, body string) (*http.Response, string), *int) {
	t.Helper()
	calls := new(int)
	post := serveKeyed(t, keys, idempotency.Options{}, func(w http.ResponseWriter, r *http.Request) {
		*calls++
		if *calls == 1 {
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"id":"t_run"}`)
	})
	if resp, _ := post(key, `{}`); resp.StatusCode != http.StatusInternalServerError {
		t.Fatalf("first: %d", resp.StatusCode)
	}
	return post, calls
}

// settleWith returns a sweeper of keys, with no grace (a key released as
// failed is abandoned at once), whose hook settles every key with resp.
func settleWith(t *testing.T, keys idempotency.Store, resp idempotency.StoredResponse) *idempotency.Sweeper {
	return &idempotency.Sweeper{
		Store:  keys,
		Grace:  time.Nanosecond,
		Logger: testLogger(t),
		Settle: func(context.Context, idempotency.KeyInfo) (idempotency.Settlement, error) {
			r := resp
			return idempotency.Settlement{Response: &r}, nil
		},
	}
}

// TestSweptSettlementStoresNoCredentialHeader: a hook that settles a key
// with credential headers and another request's key has them left out,
// as a handler's are: the client's retry gets the settlement without them,
// and its own key echoed.
func TestSweptSettlementStoresNoCredentialHeader(t *testing.T) {
	for _, st := range storages {
		t.Run(st.name, func(t *testing.T) {
			keys := st.newStorage(t).Keys
			post, calls := releasedKey(t, keys, "k-swept")
			s := settleWith(t, keys, idempotency.StoredResponse{Status: http.StatusCreated, ContentType: "application/json",
				Header: credentialHeaders, Body: []byte(`{"id":"t_1"}`)})
			if res, err := s.Sweep(context.Background()); err != nil || res != (idempotency.SweepResult{Found: 1, Completed: 1}) {
				t.Fatalf("Sweep = %+v, %v; want one completed", res, err)
			}
			info, err := keys.(idempotency.Inspector).Lookup(context.Background(), "c", "k-swept", false)
			if err != nil || info.Response == nil {
				t.Fatalf("Lookup = %+v, %v", info, err)
			}
			if want := map[string]string{"Location": "/v1/things/t_1"}; !maps.Equal(info.Response.Header, want) {
				t.Errorf("stored headers %v, want %v", info.Response.Header, want)
			}
			resp, body := post("k-swept", `{}`)
			mustReplayNoCredential(t, resp, body, "k-swept")
			if *calls != 1 {
				t.Errorf("the handler ran %d times, want 1", *calls)
			}
		})
	}
}

// TestSweptSettlementServerErrorNotStored: a hook that settles a key with
// a 503 (or another status the middleware would not store: a 429, a 409,
// a 1xx, which is no final answer) does not make
// it the key's outcome: its writes are rolled back, the key is released
// as failed, left for the next sweep, and the retry of its request runs
// it; with StoreServerErrors, as the middleware, the 503 is stored.
func TestSweptSettlementServerErrorNotStored(t *testing.T) {
	for _, st := range storages {
		t.Run(st.name, func(t *testing.T) {
			for _, status := range []int{http.StatusServiceUnavailable, http.StatusTooManyRequests, http.StatusConflict, http.StatusEarlyHints} {
				keys := st.newStorage(t).Keys
				key := fmt.Sprintf("k-%d", status)
				post, calls := releasedKey(t, keys, key)
				s := settleWith(t, keys, idempotency.StoredResponse{Status: status, ContentType: "application/json", Body: []byte(`{}`)})
				if res, err := s.Sweep(context.Background()); err != nil || res != (idempotency.SweepResult{Found: 1, Left: 1}) {
					t.Fatalf("settled with %d: Sweep = %+v, %v; want one left", status, res, err)
				}
				if resp, body := post(key, `{"x":2}`); resp.StatusCode != http.StatusUnprocessableEntity {
					t.Errorf("settled with %d: another request with the key: %d %s, want 422 (released as failed)", status, resp.StatusCode, body)
				}
				resp, body := post(key, `{}`)
				if resp.StatusCode != http.StatusCreated || resp.Header.Get("Idempotent-Replayed") != "" || body != `{"id":"t_run"}` {
					t.Errorf("settled with %d: the retry got %d replayed=%q %s, want its own run's 201", status, resp.StatusCode,
						resp.Header.Get("Idempotent-Replayed"), body)
				}
				if *calls != 2 {
					t.Errorf("settled with %d: the handler ran %d times, want 2", status, *calls)
				}
			}

			keys := st.newStorage(t).Keys
			post, _ := releasedKey(t, keys, "k-stored")
			s := settleWith(t, keys, idempotency.StoredResponse{Status: http.StatusServiceUnavailable, ContentType: "application/json", Body: []byte(`{}`)})
			s.StoreServerErrors = true
			if res, err := s.Sweep(context.Background()); err != nil || res != (idempotency.SweepResult{Found: 1, Completed: 1}) {
				t.Fatalf("StoreServerErrors: Sweep = %+v, %v; want one completed", res, err)
			}
			if resp, _ := post("k-stored", `{}`); resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Idempotent-Replayed") != "true" {
				t.Errorf("StoreServerErrors: the retry got %d, want the stored 503", resp.StatusCode)
			}
		})
	}
}

// TestSealRequireRefusesClearResponse: a Sealed store whose keys require
// seals refuses to replay a response stored in the clear (500, nothing
// run), still answers 422 to another request with its key, and replays
// the responses it sealed; without RequireSealed the clear one replays.
func TestSealRequireRefusesClearResponse(t *testing.T) {
	for _, st := range storages {
		t.Run(st.name, func(t *testing.T) {
			keys := st.newStorage(t).Keys
			var calls int
			h := func(w http.ResponseWriter, r *http.Request) {
				calls++
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusCreated)
				fmt.Fprintf(w, `{"id":"t_%d","card":"4242"}`, calls)
			}
			clear := serveKeyed(t, keys, idempotency.Options{}, h)
			if resp, _ := clear("k-clear", `{}`); resp.StatusCode != http.StatusCreated {
				t.Fatalf("first: %d", resp.StatusCode)
			}
			sealKeys := storetest.SealKeys(t, "k1")
			required, err := sealKeys.RequireSealed()
			if err != nil {
				t.Fatal(err)
			}
			lenient := serveKeyed(t, idempotency.Sealed(keys, sealKeys), idempotency.Options{}, h)
			if resp, body := lenient("k-clear", `{}`); resp.StatusCode != http.StatusCreated || body != `{"id":"t_1","card":"4242"}` {
				t.Errorf("without RequireSealed: %d %s, want the clear response replayed", resp.StatusCode, body)
			}
			strict := serveKeyed(t, idempotency.Sealed(keys, required), idempotency.Options{}, h)
			resp, body := strict("k-clear", `{}`)
			if resp.StatusCode != http.StatusInternalServerError || strings.Contains(body, "4242") {
				t.Errorf("with RequireSealed: %d %s, want 500 and nothing of the stored response", resp.StatusCode, body)
			}
			if resp, body := strict("k-clear", `{"other":1}`); resp.StatusCode != http.StatusUnprocessableEntity {
				t.Errorf("another request with the key: %d %s, want 422", resp.StatusCode, body)
			}
			first, firstBody := strict("k-sealed", `{}`)
			if again, body := strict("k-sealed", `{}`); first.StatusCode != http.StatusCreated || again.StatusCode != http.StatusCreated || body != firstBody {
				t.Errorf("a sealed response with RequireSealed: %d %s, then %d %s; want it replayed", first.StatusCode, firstBody, again.StatusCode, body)
			}
			if calls != 2 {
				t.Errorf("the handler ran %d times, want 2", calls)
			}
		})
	}
	off, err := idempotency.NewSealKeys(idempotency.SealKey{ID: "k1", Secret: make([]byte, 32), OpenOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := off.RequireSealed(); err == nil {
		t.Error("RequireSealed with an open-only first key: no error")
	}
}
