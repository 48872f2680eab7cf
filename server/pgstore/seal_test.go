package pgstore_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
	"github.com/idemkit/idem/server/storetest"
)

// TestConformanceSealed runs the conformance suite on pgstore with sealing
// on (TestConformance runs it with sealing off). A business write is a
// row inserted through pgstore.Tx, which finds the store's
// transaction beneath the seal's unit of work.
func TestConformanceSealed(t *testing.T) {
	storetest.ExerciseSealed(t, func(t *testing.T) storetest.Backend {
		pool := widePool(t, 8)
		return storetest.Backend{
			Store: pgstore.New(pool),
			Write: write,
			Written: func(ctx context.Context, name string) (bool, error) {
				return written(ctx, pool, name)
			},
			Elapse: elapseAll(pool),
		}
	})
}

// sealedAPI is a payments-like handler behind the middleware on a sealed
// pgstore: it inserts a row through the request's transaction and answers
// 201 with a body worth sealing. Requests name their client in X-Client.
type sealedAPI struct {
	url   string
	calls *atomic.Int32 // handler runs, shared by the APIs of one test
}

func newSealedAPI(t *testing.T, pool *pgxpool.Pool, keys *idempotency.SealKeys, calls *atomic.Int32) sealedAPI {
	t.Helper()
	keyed := idempotency.Middleware(idempotency.Sealed(pgstore.New(pool), keys), idempotency.Options{
		ClientID: func(r *http.Request) (string, bool) { return r.Header.Get("X-Client"), r.Header.Get("X-Client") != "" },
	})
	ts := httptest.NewServer(keyed(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := calls.Add(1)
		claim, _ := idempotency.ClaimFromContext(r.Context())
		if err := write(r.Context(), fmt.Sprintf("%s/%s", claim.ClientID, claim.Key)); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Location", "/v1/payments/pay_"+claim.Key)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":"pay_%s","card":"4242424242424242","run":%d}`+"\n", claim.Key, n)
	})))
	t.Cleanup(ts.Close)
	return sealedAPI{url: ts.URL, calls: calls}
}

// sealedReply is an answer of a sealedAPI.
type sealedReply struct {
	status   int
	header   http.Header
	body     []byte
	problem  string // the problem type of an application/problem+json body
	replayed bool
}

func (a sealedAPI) post(t *testing.T, client, key string) sealedReply {
	t.Helper()
	req, err := http.NewRequest("POST", a.url+"/v1/payments", strings.NewReader(`{"amount":4200}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Client", client)
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	r := sealedReply{status: resp.StatusCode, header: resp.Header, body: body, replayed: resp.Header.Get("Idempotent-Replayed") == "true"}
	if resp.Header.Get("Content-Type") == "application/problem+json" {
		var p struct{ Type string }
		_ = json.Unmarshal(body, &p)
		r.problem = p.Type
	}
	return r
}

// sameAnswer checks that replay is first again, byte for byte: status,
// content type, Location and body.
func sameAnswer(t *testing.T, what string, first, replay sealedReply) {
	t.Helper()
	if !replay.replayed || replay.status != first.status || !bytes.Equal(replay.body, first.body) ||
		replay.header.Get("Content-Type") != first.header.Get("Content-Type") || replay.header.Get("Location") != first.header.Get("Location") {
		t.Errorf("%s: %d %v %q, want the replay of %d %v %q", what, replay.status, replay.header, replay.body, first.status, first.header, first.body)
	}
}

// mustBeRefused checks that r is the 500 of a stored response that cannot
// be opened.
func mustBeRefused(t *testing.T, what string, r sealedReply) {
	t.Helper()
	if r.status != http.StatusInternalServerError || r.problem != idempotency.ProblemResponseSealed || r.replayed {
		t.Errorf("%s: %d %q, want 500 %s", what, r.status, r.body, idempotency.ProblemResponseSealed)
	}
}

// execSQL runs a statement on pool.
func execSQL(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), sql, args...); err != nil {
		t.Fatal(err)
	}
}

// TestSealedRows serves keyed payments through the middleware on a sealed
// pgstore and works on the rows with SQL, as whoever can write the table
// could: the row holds the response sealed (status in the clear); replays
// are byte for byte, also across a key rotation between two servers; a
// tampered body, a changed status, and a sealed response copied to
// another client's row are refused with 500, never run again, and the key
// stays completed; a key withdrawn too early is refused the same way.
func TestSealedRows(t *testing.T) {
	pool := migratedPool(t, nil)
	var calls atomic.Int32
	api := newSealedAPI(t, pool, storetest.SealKeys(t, "k1"), &calls)
	ctx := context.Background()

	first := api.post(t, "a", "key-1")
	if first.status != http.StatusCreated || first.replayed {
		t.Fatalf("first: %d %q", first.status, first.body)
	}
	sameAnswer(t, "replay", first, api.post(t, "a", "key-1"))
	var ct string
	var headers, body []byte
	if err := pool.QueryRow(ctx, `
		SELECT response_content_type, response_headers::text::bytea, response_body FROM idempotency_keys
		WHERE client_id = 'a' AND idempotency_key = 'key-1' AND status = 'completed' AND response_status = 201`).
		Scan(&ct, &headers, &body); err != nil {
		t.Fatal(err)
	}
	if ct != idempotency.SealedMediaType+"; key=k1" || len(headers) != 0 || bytes.Contains(body, []byte("4242")) || bytes.Contains(body, []byte("pay_")) {
		t.Errorf("row: content type %q, headers %q, body %q: want it sealed with k1", ct, headers, body)
	}

	// Rotation: a second server seals with k2 and still opens k1's rows.
	rotated := newSealedAPI(t, pool, storetest.SealKeys(t, "k2", "k1"), &calls)
	sameAnswer(t, "replay of k1's row by the server with k2 first", first, rotated.post(t, "a", "key-1"))
	second := rotated.post(t, "a", "key-2")
	sameAnswer(t, "replay of k2's row by the server with k2 first", second, rotated.post(t, "a", "key-2"))
	if err := pool.QueryRow(ctx, `SELECT response_content_type FROM idempotency_keys WHERE client_id = 'a' AND idempotency_key = 'key-2'`).Scan(&ct); err != nil {
		t.Fatal(err)
	}
	if ct != idempotency.SealedMediaType+"; key=k2" {
		t.Errorf("new row of the rotated server: content type %q, want sealed with k2", ct)
	}
	// The first server does not hold k2.
	mustBeRefused(t, "k2's row on the server without k2", api.post(t, "a", "key-2"))
	// Nor does a server without sealing.
	plain := idempotency.Middleware(pgstore.New(pool), idempotency.Options{
		ClientID: func(r *http.Request) (string, bool) { return "a", true },
	})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { calls.Add(1); w.WriteHeader(http.StatusCreated) }))
	rec := httptest.NewRecorder()
	req := httptest.NewRequest("POST", "/v1/payments", strings.NewReader(`{"amount":4200}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", "key-1")
	plain.ServeHTTP(rec, req)
	if rec.Code != http.StatusInternalServerError || !strings.Contains(rec.Body.String(), idempotency.ProblemResponseSealed) {
		t.Errorf("a sealed row on a server without sealing: %d %s", rec.Code, rec.Body)
	}

	// Tampering: a flipped byte of the ciphertext, a changed status.
	third := api.post(t, "a", "key-3")
	execSQL(t, pool, `UPDATE idempotency_keys SET response_body = set_byte(response_body, 40, get_byte(response_body, 40) # 1)
		WHERE client_id = 'a' AND idempotency_key = 'key-3'`)
	mustBeRefused(t, "a tampered body", api.post(t, "a", "key-3"))
	fourth := api.post(t, "a", "key-4")
	execSQL(t, pool, `UPDATE idempotency_keys SET response_status = 200 WHERE client_id = 'a' AND idempotency_key = 'key-4'`)
	mustBeRefused(t, "a changed status", api.post(t, "a", "key-4"))

	// A sealed response copied to another client's row with the same key.
	other := api.post(t, "b", "key-1")
	execSQL(t, pool, `UPDATE idempotency_keys AS b SET response_content_type = a.response_content_type, response_body = a.response_body
		FROM idempotency_keys AS a
		WHERE a.client_id = 'a' AND a.idempotency_key = 'key-1' AND b.client_id = 'b' AND b.idempotency_key = 'key-1'`)
	mustBeRefused(t, "a row copied to another client's key", api.post(t, "b", "key-1"))

	for _, r := range []sealedReply{second, third, fourth, other} {
		if r.status != http.StatusCreated {
			t.Errorf("a first request: %d %q", r.status, r.body)
		}
	}
	// Five first requests ran their handler, once each; nothing else did.
	if n := calls.Load(); n != 5 {
		t.Errorf("the handler ran %d times, want 5 (one per key)", n)
	}
	var completed int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_keys WHERE status = 'completed'`).Scan(&completed); err != nil {
		t.Fatal(err)
	}
	if completed != 5 {
		t.Errorf("%d completed keys, want the 5 still completed", completed)
	}
	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM writes`).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if rows != 5 {
		t.Errorf("%d rows written, want 5", rows)
	}
}
