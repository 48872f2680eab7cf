package idempotency

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
)

// testSealKey returns the test key of id, the same on every run.
func testSealKey(id string) SealKey {
	secret := sha256.Sum256([]byte("test seal key " + id))
	return SealKey{ID: id, Secret: secret[:]}
}

// testSealKeys returns the key set of ids, the first sealing.
func testSealKeys(t testing.TB, ids ...string) *SealKeys {
	t.Helper()
	var keys []SealKey
	for _, id := range ids {
		keys = append(keys, testSealKey(id))
	}
	ks, err := NewSealKeys(keys...)
	if err != nil {
		t.Fatal(err)
	}
	return ks
}

func TestNewSealKeysRefuses(t *testing.T) {
	good := testSealKey("k1")
	for _, tt := range []struct {
		name string
		keys []SealKey
		want string
	}{
		{"no key", nil, "at least one key"},
		{"empty id", []SealKey{{ID: "", Secret: good.Secret}}, "seal key id"},
		{"id with a space", []SealKey{{ID: "k 1", Secret: good.Secret}}, "seal key id"},
		{"id with a semicolon", []SealKey{{ID: "k1;x=2", Secret: good.Secret}}, "seal key id"},
		{"id too long", []SealKey{{ID: strings.Repeat("k", 65), Secret: good.Secret}}, "seal key id"},
		{"short secret", []SealKey{{ID: "k1", Secret: good.Secret[:16]}}, "16 bytes long"},
		{"no secret", []SealKey{{ID: "k1"}}, "0 bytes long"},
		{"duplicate id", []SealKey{good, good}, "given twice"},
		{"a secret as the id", []SealKey{good, {ID: base64.StdEncoding.EncodeToString(good.Secret), Secret: good.Secret}}, "seal key id of key 2 (of 2)"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ks, err := NewSealKeys(tt.keys...)
			if err == nil || ks != nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("NewSealKeys: %v, %v; want an error saying %q", ks, err, tt.want)
			}
			if secret := base64.StdEncoding.EncodeToString(good.Secret); strings.Contains(err.Error(), secret[:8]) {
				t.Errorf("NewSealKeys: %v shows the secret", err)
			}
		})
	}
	// The secret is copied: changing the caller's slice changes nothing.
	k := testSealKey("k1")
	ks, err := NewSealKeys(k)
	if err != nil {
		t.Fatal(err)
	}
	sealed, _ := ks.Seal("c", "k", "op-1", StoredResponse{Status: 201, Body: []byte("x")})
	k.Secret[0] ^= 1
	if _, err := ks.Open("c", "k", "op-1", sealed); err != nil {
		t.Errorf("after the caller changed its secret: %v", err)
	}
}

// sealCases are responses that must come back byte for byte.
var sealCases = []StoredResponse{
	{Status: 201, ContentType: "application/json", Header: map[string]string{"Location": "/v1/payments/pay_1", "Etag": `"x"`},
		Body: []byte(`{"id":"pay_1","card":"4242424242424242"}`)},
	{Status: 204},
	{Status: 200, ContentType: "application/octet-stream", Body: []byte("\x00\xff\xfe binary \x00")},
	{Status: 422, ContentType: "application/problem+json; charset=utf-8", Header: map[string]string{"X-Note": "naïve ✓", "Empty": ""},
		Body: bytes.Repeat([]byte("long "), 50000)},
	{Status: 302, Header: map[string]string{"Location": "/elsewhere"}},
}

func TestSealOpen(t *testing.T) {
	ks := testSealKeys(t, "k1")
	for i, resp := range sealCases {
		sealed, err := ks.Seal("cli_1", "key-1", "op-1", resp)
		if err != nil {
			t.Fatal(err)
		}
		if sealed.Status != resp.Status || sealed.ContentType != SealedMediaType+"; key=k1" || sealed.Header != nil {
			t.Errorf("case %d: sealed as %d %q %v, want the status, the sealed type and no header", i, sealed.Status, sealed.ContentType, sealed.Header)
		}
		for _, clear := range [][]byte{[]byte("4242"), []byte("/v1/payments"), []byte("naïve"), []byte("binary"), []byte("long long")} {
			if bytes.Contains(sealed.Body, clear) {
				t.Errorf("case %d: the sealed body shows %q", i, clear)
			}
		}
		again, _ := ks.Seal("cli_1", "key-1", "op-1", resp)
		if bytes.Equal(again.Body, sealed.Body) {
			t.Errorf("case %d: two seals of one response gave the same bytes", i)
		}
		got, err := ks.Open("cli_1", "key-1", "op-1", sealed)
		if err != nil {
			t.Fatalf("case %d: Open: %v", i, err)
		}
		if !sameStored(got, resp) {
			t.Errorf("case %d: opened %+v, want %+v", i, got, resp)
		}
	}
}

// sameStored reports whether a and b are the same response, an empty body
// or header set being the same as none.
func sameStored(a, b StoredResponse) bool {
	return a.Status == b.Status && a.ContentType == b.ContentType && maps.Equal(a.Header, b.Header) && bytes.Equal(a.Body, b.Body)
}

// TestSealBinding opens a sealed response for other rows and after every
// change of a byte: it never opens, and the error says why.
func TestSealBinding(t *testing.T) {
	ks := testSealKeys(t, "k1", "k2")
	resp := sealCases[0]
	sealed, err := ks.Seal("ab", "c", "op-1", resp)
	if err != nil {
		t.Fatal(err)
	}
	mustNotOpen := func(what, client, key string, s StoredResponse, why string) {
		t.Helper()
		got, err := ks.Open(client, key, "op-1", s)
		if !errors.Is(err, ErrCannotOpen) || !strings.Contains(err.Error(), why) {
			t.Errorf("%s: %+v, %v; want ErrCannotOpen saying %q", what, got, err, why)
		}
	}
	mustNotOpen("another client", "ab2", "c", sealed, "copied from another")
	mustNotOpen("another key", "ab", "c2", sealed, "copied from another")
	mustNotOpen("the client and key split elsewhere", "a", "bc", sealed, "copied from another")
	if got, err := ks.Open("ab", "c", "op-2", sealed); !errors.Is(err, ErrCannotOpen) {
		t.Errorf("another operation of the same key (a key reused after it expired): %+v, %v; want ErrCannotOpen", got, err)
	}
	other := sealed
	other.Status = 200
	mustNotOpen("another status", "ab", "c", other, "status was changed")
	other = sealed
	other.ContentType = SealedMediaType + "; key=k2"
	mustNotOpen("the content type naming another key", "ab", "c", other, "was altered")
	other.ContentType = SealedMediaType + "; key="
	mustNotOpen("the content type naming no key", "ab", "c", other, "was altered")
	for i := range sealed.Body {
		other = sealed
		other.Body = bytes.Clone(sealed.Body)
		other.Body[i] ^= 0x20
		if _, err := ks.Open("ab", "c", "op-1", other); !errors.Is(err, ErrCannotOpen) {
			t.Fatalf("byte %d changed: %v, want ErrCannotOpen", i, err)
		}
	}
	for n := range len(sealed.Body) {
		other = sealed
		other.Body = sealed.Body[:n]
		if _, err := ks.Open("ab", "c", "op-1", other); !errors.Is(err, ErrCannotOpen) {
			t.Fatalf("cut to %d bytes: %v, want ErrCannotOpen", n, err)
		}
	}
	withdrawn := testSealKeys(t, "k2")
	if _, err := withdrawn.Open("ab", "c", "op-1", sealed); !errors.Is(err, ErrCannotOpen) || !strings.Contains(err.Error(), `key "k1", which is not among`) {
		t.Errorf("k1 withdrawn: %v", err)
	}
	// A key of the same id and another secret is another key.
	impostor, _ := NewSealKeys(SealKey{ID: "k1", Secret: bytes.Repeat([]byte{1}, 32)})
	if _, err := impostor.Open("ab", "c", "op-1", sealed); !errors.Is(err, ErrCannotOpen) {
		t.Errorf("another secret under the id k1: %v", err)
	}
}

func TestSealRotation(t *testing.T) {
	old := testSealKeys(t, "k1")
	sealed, _ := old.Seal("c", "k", "op-1", sealCases[0])
	rotated := testSealKeys(t, "k2", "k1")
	if got, err := rotated.Open("c", "k", "op-1", sealed); err != nil || !sameStored(got, sealCases[0]) {
		t.Errorf("k1's response with k2 first: %+v, %v", got, err)
	}
	if s, _ := rotated.Seal("c", "k", "op-1", sealCases[0]); s.ContentType != SealedMediaType+"; key=k2" {
		t.Errorf("sealed after the rotation with %q, want k2", s.ContentType)
	}
	off, err := NewSealKeys(SealKey{ID: "k2", Secret: testSealKey("k2").Secret, OpenOnly: true}, testSealKey("k1"))
	if err != nil {
		t.Fatal(err)
	}
	if s, _ := off.Seal("c", "k", "op-1", sealCases[0]); !sameStored(s, sealCases[0]) {
		t.Errorf("sealed with an open-only first key: %+v, want the response as it is", s)
	}
	if got, err := off.Open("c", "k", "op-1", sealed); err != nil || !sameStored(got, sealCases[0]) {
		t.Errorf("k1's response with sealing off: %+v, %v", got, err)
	}
}

func TestSealKeyID(t *testing.T) {
	for _, tt := range []struct {
		ct     string
		id     string
		sealed bool
	}{
		{"application/json", "", false},
		{"", "", false},
		{"application/vnd.idemkit", "", false},
		{SealedMediaType + "; key=k1", "k1", true},
		{"Application/Vnd.Idemkit.Sealed; key=2026-01", "2026-01", true},
		{SealedMediaType, "", true},
		{SealedMediaType + ";key=k1", "k1", true},
		{SealedMediaType + " ; KEY=k1", "k1", true},
		{SealedMediaType + "; key=k 1", "", true},
		{SealedMediaType + "; key=k1; key=k2", "", true},
		{SealedMediaType + "; key=k1; v=2", "", true},
		{SealedMediaType + ";", "", true},
		// Types of the handler's own that only begin like it.
		{SealedMediaType + "report+json", "", false},
		{SealedMediaType + "report+json; key=k1", "", false},
		{SealedMediaType + ".v2", "", false},
		{SealedMediaType + "/x", "", false},
		{SealedMediaType + "x; key=k1; key=k2", "", false},
	} {
		id, sealed := sealKeyID(StoredResponse{ContentType: tt.ct})
		if id != tt.id || sealed != tt.sealed {
			t.Errorf("sealKeyID(%q) = %q, %v; want %q, %v", tt.ct, id, sealed, tt.id, tt.sealed)
		}
	}
}

// FuzzSealOpen seals any response for any row and opens it: it comes back
// as it was, and opens for no other row; a sealed body of any bytes never
// makes Open panic.
func FuzzSealOpen(f *testing.F) {
	for _, c := range sealCases {
		var name, value string
		for name, value = range c.Header {
			break
		}
		f.Add(c.Status, "cli", "key", c.ContentType, name, value, c.Body)
	}
	ks := testSealKeys(f, "k1")
	f.Fuzz(func(t *testing.T, status int, client, key, ct, name, value string, body []byte) {
		resp := StoredResponse{Status: status, ContentType: ct, Body: body}
		if name != "" {
			resp.Header = map[string]string{name: value}
		}
		sealed, err := ks.Seal(client, key, "op", resp)
		if err != nil {
			t.Fatal(err)
		}
		got, err := ks.Open(client, key, "op", sealed)
		if err != nil || !sameStored(got, resp) {
			t.Fatalf("opened %+v, %v; want %+v", got, err, resp)
		}
		if _, err := ks.Open(client+"x", key, "op", sealed); err == nil {
			t.Fatal("opened for another client")
		}
		// Any bytes as a sealed body.
		_, _ = ks.Open(client, key, "op", StoredResponse{Status: status, ContentType: SealedMediaType + "; key=k1", Body: body})
	})
}

// sealedStoreOf returns a memory store and the same store sealed by keys.
func sealedStoreOf(t *testing.T, keys *SealKeys) (*MemoryStore, Store) {
	t.Helper()
	mem := NewMemoryStore()
	return mem, Sealed(mem, keys)
}

// storedOf returns the response the memory store holds for client's key,
// as it holds it.
func storedOf(t *testing.T, mem *MemoryStore, client, key string) StoredResponse {
	t.Helper()
	mem.mu.Lock()
	defer mem.mu.Unlock()
	k := mem.keys[keyRef{client, key}]
	if k == nil || k.rec.Status != StatusCompleted || k.rec.Response == nil {
		t.Fatalf("key %s of %s: %+v, want completed", key, client, k)
	}
	return *k.rec.clone().Response
}

// operationOf returns the operation ID of a key of mem.
func operationOf(t *testing.T, mem *MemoryStore, client, key string) string {
	t.Helper()
	mem.mu.Lock()
	defer mem.mu.Unlock()
	k := mem.keys[keyRef{client, key}]
	if k == nil {
		t.Fatalf("key %s of %s: absent", key, client)
	}
	return k.operationID
}

// sealedHandler answers 201 with a Location, an ETag and a body worth
// sealing, and counts its runs.
func sealedHandler(calls *atomic.Int32) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		n := calls.Add(1)
		c, _ := ClaimFromContext(r.Context())
		w.Header().Set("Location", "/v1/payments/pay_"+c.Key)
		w.Header().Set("Etag", fmt.Sprintf(`"%d"`, n))
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":"pay_%s","card":"4242424242424242","run":%d}`, c.Key, n)
	}
}

// mustReplay checks that again is first replayed byte for byte: status,
// the stored headers and body.
func mustReplay(t *testing.T, first, again reply) {
	t.Helper()
	if !again.replayed() || again.status != first.status || !bytes.Equal(again.body, first.body) {
		t.Errorf("replay %d %q replayed=%v, want %d %q", again.status, again.body, again.replayed(), first.status, first.body)
	}
	for _, h := range []string{"Content-Type", "Content-Length", "Location", "Etag", "Idempotency-Key"} {
		if again.header.Get(h) != first.header.Get(h) {
			t.Errorf("replayed %s = %q, want %q", h, again.header.Get(h), first.header.Get(h))
		}
	}
	if again.header.Get(RedactedHeader) != "" {
		t.Errorf("a replay of a whole response says %s: %q", RedactedHeader, again.header.Get(RedactedHeader))
	}
}

// mustRefuseSealed checks that r is the 500 of a response that cannot be
// opened.
func mustRefuseSealed(t *testing.T, what string, r reply) {
	t.Helper()
	if r.status != http.StatusInternalServerError || r.replayed() {
		t.Fatalf("%s: %d %q replayed=%v, want 500", what, r.status, r.body, r.replayed())
	}
	if p := r.problem(t); p.Type != ProblemResponseSealed {
		t.Errorf("%s: problem %q, want %q", what, p.Type, ProblemResponseSealed)
	}
}

// TestSealedMiddleware serves keyed requests through Middleware on a
// sealed memory store: the store holds them sealed, replays are the first
// response byte for byte, also after a key rotation; a tampered response,
// one copied to another client's key, one whose key was withdrawn, and a
// sealed one on a server without sealing answer 500 ProblemResponseSealed,
// and never run the handler again nor free the key.
func TestSealedMiddleware(t *testing.T) {
	var calls atomic.Int32
	mem, sealed := sealedStoreOf(t, testSealKeys(t, "k1"))
	ts := mwServer(t, sealed, Options{}, sealedHandler(&calls))

	first := ts.mustSend(t, keyed("k", `{"a":1}`))
	if first.status != http.StatusCreated || first.replayed() {
		t.Fatalf("first: %d %q", first.status, first.body)
	}
	mustReplay(t, first, ts.mustSend(t, keyed("k", `{"a":1}`)))
	at := storedOf(t, mem, "c", "k")
	if id, ok := sealKeyID(at); !ok || id != "k1" || at.Status != http.StatusCreated || bytes.Contains(at.Body, []byte("4242")) {
		t.Errorf("at rest: %d %q %q, want the status and the rest sealed with k1", at.Status, at.ContentType, at.Body)
	}

	// Rotation: another server with k2 first replays k1's row.
	rotated := mwServer(t, Sealed(mem, testSealKeys(t, "k2", "k1")), Options{}, sealedHandler(&calls))
	mustReplay(t, first, rotated.mustSend(t, keyed("k", `{"a":1}`)))
	second := rotated.mustSend(t, keyed("k2", `{"a":1}`))
	mustReplay(t, second, rotated.mustSend(t, keyed("k2", `{"a":1}`)))
	if id, _ := sealKeyID(storedOf(t, mem, "c", "k2")); id != "k2" {
		t.Errorf("a new key after the rotation is sealed with %q, want k2", id)
	}
	// The first server does not hold k2, nor does a server without sealing.
	mustRefuseSealed(t, "k2's row on the server with k1 only", ts.mustSend(t, keyed("k2", `{"a":1}`)))
	plain := mwServer(t, mem, Options{}, sealedHandler(&calls))
	mustRefuseSealed(t, "a sealed row on a server without sealing", plain.mustSend(t, keyed("k", `{"a":1}`)))

	// Tampering, and a copy to another client's row with the same key.
	ts.mustSend(t, keyed("k3", `{"a":1}`))
	mem.mu.Lock()
	mem.keys[keyRef{"c", "k3"}].rec.Response.Body[30] ^= 1
	mem.mu.Unlock()
	mustRefuseSealed(t, "a tampered row", ts.mustSend(t, keyed("k3", `{"a":1}`)))

	other := mwServer(t, sealed, Options{ClientID: func(*http.Request) (string, bool) { return "d", true }}, sealedHandler(&calls))
	other.mustSend(t, keyed("k", `{"a":1}`))
	copied := storedOf(t, mem, "c", "k")
	mem.mu.Lock()
	mem.keys[keyRef{"d", "k"}].rec.Response = &copied
	mem.mu.Unlock()
	mustRefuseSealed(t, "client c's row copied to client d's", other.mustSend(t, keyed("k", `{"a":1}`)))
	mustRefuseSealed(t, "again", other.mustSend(t, keyed("k", `{"a":1}`)))

	if n := calls.Load(); n != 4 {
		t.Errorf("the handler ran %d times, want 4: once per key and client", n)
	}
	for _, ref := range []keyRef{{"c", "k"}, {"c", "k2"}, {"c", "k3"}, {"d", "k"}} {
		res, err := mem.Claim(context.Background(), ClaimRequest{ClientID: ref.client, Key: ref.key, Method: "POST", Path: "/v1/payments",
			Fingerprint: []byte("another request")})
		if err != nil || res.Outcome != Exists || res.Record.Status != StatusCompleted {
			t.Errorf("key %v after the refusals: %v %+v, want it completed", ref, err, res)
		}
	}
}

// TestSealedClaimsInOneTransaction: a sealed store claims in one
// transaction when the store it wraps can (the handler sees a claim made
// in one transaction), and in a commit of its own when it cannot; the
// replay opens either way.
func TestSealedClaimsInOneTransaction(t *testing.T) {
	for _, inner := range []Store{NewMemoryStore(), plainStore{NewMemoryStore()}} {
		_, canTx := inner.(TxClaimer)
		t.Run(fmt.Sprintf("TxClaimer=%v", canTx), func(t *testing.T) {
			var oneTx []bool
			ts := mwServer(t, Sealed(inner, testSealKeys(t, "k1")), Options{OneTransaction: true},
				func(w http.ResponseWriter, r *http.Request) {
					c, _ := ClaimFromContext(r.Context())
					oneTx = append(oneTx, c.OneTransaction)
					w.WriteHeader(http.StatusCreated)
					io.WriteString(w, `{"id":"ord_1"}`)
				})
			first := ts.mustSend(t, keyed("k", `{"a":1}`))
			mustReplay(t, first, ts.mustSend(t, keyed("k", `{"a":1}`)))
			if len(oneTx) != 1 || oneTx[0] != canTx {
				t.Errorf("claims in one transaction as the handler saw them: %v, want [%v]", oneTx, canTx)
			}
		})
	}
}

// plainStore hides every method of its Store but the Store's own.
type plainStore struct{ Store }

// TestSealedMismatchFirst: a request that is not the key's own gets 422,
// whether or not the stored response opens.
func TestSealedMismatchFirst(t *testing.T) {
	var calls atomic.Int32
	mem := NewMemoryStore()
	ts := mwServer(t, Sealed(mem, testSealKeys(t, "k1")), Options{}, sealedHandler(&calls))
	ts.mustSend(t, keyed("k", `{"a":1}`))
	withdrawn := mwServer(t, Sealed(mem, testSealKeys(t, "k2")), Options{}, sealedHandler(&calls))
	if r := withdrawn.mustSend(t, keyed("k", `{"a":2}`)); r.status != http.StatusUnprocessableEntity {
		t.Errorf("another request with the key: %d %q, want 422", r.status, r.body)
	}
}

// TestSealedTxUnwraps: behind Middleware on a sealed store, the handler
// reaches the store's own unit of work (MemoryStore.Stage works), and its
// writes commit with the sealed outcome.
func TestSealedTxUnwraps(t *testing.T) {
	mem := NewMemoryStore()
	var rows journal
	h := testHandler(t, Sealed(mem, testSealKeys(t, "k1")), Options{}, func(w http.ResponseWriter, r *http.Request) {
		tx, ok := TxFromContext(r.Context())
		if _, mine := tx.(*memTx); !ok || !mine {
			t.Errorf("TxFromContext = %T, %v; want the memory store's own", tx, ok)
		}
		if !mem.Stage(r.Context(), func() error { rows.add("row"); return nil }) {
			t.Error("Stage refused the unit of work beneath the seal's")
		}
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "ok")
	})
	if r := serve(t, h, keyed("k", "{}")); r.status != http.StatusCreated {
		t.Fatalf("%d %q", r.status, r.body)
	}
	if got := rows.list(); len(got) != 1 {
		t.Errorf("rows %q, want the staged one", got)
	}
}
