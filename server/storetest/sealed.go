package storetest

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"maps"
	"mime"
	"testing"

	"github.com/idemkit/idem/server/idempotency"
)

// ExerciseSealed runs the conformance suite with sealing on: every test of
// [Exercise] on newBackend's store wrapped in [idempotency.Sealed] (the
// subtest Suite), so that sealing changes nothing of what a store does and
// the store keeps a sealed response (a binary body, a content type naming
// the key) byte for byte; then the tests of sealing at rest, which read
// the store under the seal: what it holds is sealed, a sealed response
// copied to another row does not open, and keys rotate. A store passes
// both Exercise and ExerciseSealed; newBackend is the same.
func ExerciseSealed(t *testing.T, newBackend func(t *testing.T) Backend) {
	keys := SealKeys(t, "k1")
	t.Run("Suite", func(t *testing.T) {
		Exercise(t, func(t *testing.T) Backend { return sealedBackend(newBackend(t), keys) })
	})
	tests := []struct {
		name string
		run  func(t *testing.T, b Backend)
	}{
		{"SealedAtRest", testSealedAtRest},
		{"SealedCopiedToAnotherRow", testSealedCopied},
		{"SealedCopiedToAReusedKey", testSealedReusedKey},
		{"SealedKeyRotation", testSealedRotation},
		{"UnsealedResponseReplays", testUnsealedReplays},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			tt.run(t, backendOf(t, newBackend))
		})
	}
}

// sealedBackend returns b with its store sealed by keys.
func sealedBackend(b Backend, keys *idempotency.SealKeys) Backend {
	b.Store = idempotency.Sealed(b.Store, keys)
	return b
}

// sealKey returns the suite's seal key of id: its secret depends only on
// the id, the same on every run.
func sealKey(id string, openOnly bool) idempotency.SealKey {
	secret := sha256.Sum256([]byte("storetest seal key " + id))
	return idempotency.SealKey{ID: id, Secret: secret[:], OpenOnly: openOnly}
}

// SealKeys returns a key set for tests: a key of each id, whose secret
// depends only on the id (not secret at all), the first one sealing.
func SealKeys(t testing.TB, ids ...string) *idempotency.SealKeys {
	t.Helper()
	var keys []idempotency.SealKey
	for _, id := range ids {
		keys = append(keys, sealKey(id, false))
	}
	ks, err := idempotency.NewSealKeys(keys...)
	if err != nil {
		t.Fatal(err)
	}
	return ks
}

// secretResponse is a response worth sealing.
func secretResponse(id string) idempotency.StoredResponse {
	return idempotency.StoredResponse{
		Status:      201,
		ContentType: "application/json",
		Header:      map[string]string{"Location": "/v1/orders/" + id},
		Body:        []byte(`{"id":"` + id + `","card":"4242424242424242"}` + "\n\x00\xff"),
	}
}

// sameResponse reports whether got is want, byte for byte.
func sameResponse(got *idempotency.StoredResponse, want idempotency.StoredResponse) bool {
	return got != nil && got.Status == want.Status && got.ContentType == want.ContentType &&
		maps.Equal(got.Header, want.Header) && bytes.Equal(got.Body, want.Body)
}

// stored returns the response of req's completed key as the store holds
// it, read without the seal.
func stored(t *testing.T, s idempotency.Store, req idempotency.ClaimRequest) idempotency.StoredResponse {
	t.Helper()
	rec := claim(t, s, req, idempotency.Exists).Record
	if rec.Status != idempotency.StatusCompleted || rec.Response == nil {
		t.Fatalf("key %s of %s: status %q, response %+v; want completed", req.Key, req.ClientID, rec.Status, rec.Response)
	}
	return *rec.Response
}

// mustBeSealed checks that resp is sealed with the key keyID and shows
// nothing of the response it holds.
func mustBeSealed(t *testing.T, resp idempotency.StoredResponse, keyID string, holds idempotency.StoredResponse) {
	t.Helper()
	if id, sealed := sealedWith(resp); !sealed || id != keyID {
		t.Errorf("stored content type %q: want a response sealed with key %q", resp.ContentType, keyID)
	}
	if resp.Status != holds.Status || len(resp.Header) != 0 {
		t.Errorf("stored status %d, headers %v: want the status %d in the clear and no header", resp.Status, resp.Header, holds.Status)
	}
	for _, clear := range [][]byte{holds.Body, []byte(holds.ContentType), []byte("4242424242424242"), []byte("/v1/orders/")} {
		if bytes.Contains(resp.Body, clear) {
			t.Errorf("the stored body holds %q in the clear", clear)
		}
	}
}

// testSealedAtRest completes a key through a sealed store, with a write:
// the store holds the response sealed, with its status in the clear; the
// sealed store replays it byte for byte; the write, made through the
// store's own unit of work beneath the seal's, is committed.
func testSealedAtRest(t *testing.T, b Backend) {
	sb := sealedBackend(b, SealKeys(t, "k1"))
	sealed := sb.Store
	req := request("cli_a", "key-1", "a")
	c := claim(t, sealed, req, idempotency.Claimed).Claim
	want := secretResponse("ord_1")
	if err := complete(t, sb, c, want, "w_sealed"); err != nil {
		t.Fatalf("Complete through the sealed store: %v", err)
	}
	mustBeWritten(t, b, "w_sealed", true)
	mustBeSealed(t, stored(t, b.Store, req), "k1", want)
	if got := claim(t, sealed, req, idempotency.Exists).Record.Response; !sameResponse(got, want) {
		t.Errorf("replay through the sealed store: %+v, want %+v", got, want)
	}
}

// testSealedCopied copies a sealed response, as whoever can write the
// store could, to another client's row with the same key, to another key of
// the same client, and to a row with another status: none opens, and
// Claim returns each still sealed, so the middleware refuses to replay it.
func testSealedCopied(t *testing.T, b Backend) {
	keys := SealKeys(t, "k1")
	sb := sealedBackend(b, keys)
	sealed := sb.Store
	orig := request("cli_a", "key-1", "a")
	if err := complete(t, sb, claim(t, sealed, orig, idempotency.Claimed).Claim, secretResponse("ord_a")); err != nil {
		t.Fatal(err)
	}
	copied := stored(t, b.Store, orig)
	for _, to := range []struct {
		what   string
		req    idempotency.ClaimRequest
		status int
	}{
		{"another client's row", request("cli_b", "key-1", "a"), copied.Status},
		{"another key of the client", request("cli_a", "key-2", "a"), copied.Status},
		{"a row with another status", request("cli_a", "key-3", "a"), 200},
	} {
		c := claim(t, b.Store, to.req, idempotency.Claimed).Claim
		resp := copied
		resp.Status = to.status
		resp.Body = bytes.Clone(copied.Body)
		if err := complete(t, b, c, resp); err != nil {
			t.Fatalf("%s: storing the copy: %v", to.what, err)
		}
		rec := claim(t, sealed, to.req, idempotency.Exists).Record
		got := rec.Response
		if got == nil {
			t.Fatalf("%s: no response", to.what)
		}
		if _, sealed := sealedWith(*got); !sealed {
			t.Errorf("%s: the copied response was opened: %+v", to.what, got)
		}
		if _, err := keys.Open(to.req.ClientID, to.req.Key, rec.OperationID, *got); !errors.Is(err, idempotency.ErrCannotOpen) {
			t.Errorf("%s: Open: %v, want ErrCannotOpen", to.what, err)
		}
	}
	// The original still opens.
	if got := claim(t, sealed, orig, idempotency.Exists).Record.Response; !sameResponse(got, secretResponse("ord_a")) {
		t.Errorf("the original after the copies: %+v", got)
	}
}

// testSealedRotation rotates the keys: a response sealed with k1 opens
// with k2 first and k1 after it, and new ones are sealed with k2; once k1
// is withdrawn, its responses stay sealed and k2's still open; with k2
// first and open-only, new responses are stored in the clear and k2's
// still open.
func testSealedRotation(t *testing.T, b Backend) {
	old := sealedBackend(b, SealKeys(t, "k1"))
	req1 := request("cli_a", "key-1", "a")
	if err := complete(t, old, claim(t, old.Store, req1, idempotency.Claimed).Claim, secretResponse("ord_1")); err != nil {
		t.Fatal(err)
	}
	rotated := sealedBackend(b, SealKeys(t, "k2", "k1"))
	if got := claim(t, rotated.Store, req1, idempotency.Exists).Record.Response; !sameResponse(got, secretResponse("ord_1")) {
		t.Errorf("k1's response after the rotation to k2: %+v", got)
	}
	req2 := request("cli_a", "key-2", "a")
	if err := complete(t, rotated, claim(t, rotated.Store, req2, idempotency.Claimed).Claim, secretResponse("ord_2")); err != nil {
		t.Fatal(err)
	}
	mustBeSealed(t, stored(t, b.Store, req2), "k2", secretResponse("ord_2"))

	withdrawn := idempotency.Sealed(b.Store, SealKeys(t, "k2"))
	if got := claim(t, withdrawn, req1, idempotency.Exists).Record.Response; got == nil || got.ContentType != idempotency.SealedMediaType+"; key=k1" {
		t.Errorf("k1's response once k1 is withdrawn: %+v, want it still sealed", got)
	}
	if got := claim(t, withdrawn, req2, idempotency.Exists).Record.Response; !sameResponse(got, secretResponse("ord_2")) {
		t.Errorf("k2's response once k1 is withdrawn: %+v", got)
	}

	off, err := idempotency.NewSealKeys(sealKey("k2", true))
	if err != nil {
		t.Fatal(err)
	}
	openOnly := sealedBackend(b, off)
	req3 := request("cli_a", "key-3", "a")
	if err := complete(t, openOnly, claim(t, openOnly.Store, req3, idempotency.Claimed).Claim, secretResponse("ord_3")); err != nil {
		t.Fatal(err)
	}
	if got := stored(t, b.Store, req3); !sameResponse(&got, secretResponse("ord_3")) {
		t.Errorf("stored with an open-only first key: %+v, want the response in the clear", got)
	}
	if got := claim(t, openOnly.Store, req2, idempotency.Exists).Record.Response; !sameResponse(got, secretResponse("ord_2")) {
		t.Errorf("k2's response with k2 open-only: %+v", got)
	}
}

// testUnsealedReplays stores a response without the seal, as before
// sealing was turned on: the sealed store returns it as it is.
func testUnsealedReplays(t *testing.T, b Backend) {
	req := request("cli_a", "key-1", "a")
	if err := complete(t, b, claim(t, b.Store, req, idempotency.Claimed).Claim, secretResponse("ord_1")); err != nil {
		t.Fatal(err)
	}
	sealed := idempotency.Sealed(b.Store, SealKeys(t, "k1"))
	if got := claim(t, sealed, req, idempotency.Exists).Record.Response; !sameResponse(got, secretResponse("ord_1")) {
		t.Errorf("an unsealed response through the sealed store: %+v", got)
	}
}

// testSealedReusedKey puts a sealed response back into the row of the
// same client and key after the key expired and was used again for
// another request (another amount): the response is bound to its
// operation, so it does not open for the new one, and the replay is
// refused rather than answering the old outcome.
func testSealedReusedKey(t *testing.T, b Backend) {
	keys := SealKeys(t, "k1")
	sb := sealedBackend(b, keys)
	old := with(request("cli_a", "key-1", "amount 1"), 0, retention)
	if err := complete(t, sb, claim(t, sb.Store, old, idempotency.Claimed).Claim, secretResponse("ord_old")); err != nil {
		t.Fatal(err)
	}
	rec := claim(t, b.Store, old, idempotency.Exists).Record
	if rec.Response == nil {
		t.Fatalf("the old operation's key right after it completed: %+v", rec)
	}
	copied := *rec.Response
	elapse(t, b, pause) // expired
	reused := request("cli_a", "key-1", "amount 2")
	c := claim(t, b.Store, reused, idempotency.Claimed).Claim
	if err := complete(t, b, c, copied); err != nil {
		t.Fatalf("storing the old ciphertext under the new operation: %v", err)
	}
	rec = claim(t, sb.Store, reused, idempotency.Exists).Record
	if _, sealed := sealedWith(*rec.Response); !sealed {
		t.Errorf("the old operation's answer opened for the new one: %+v", rec.Response)
	}
	if _, err := keys.Open(rec.ClientID, rec.Key, rec.OperationID, *rec.Response); !errors.Is(err, idempotency.ErrCannotOpen) {
		t.Errorf("Open under the new operation: %v, want ErrCannotOpen", err)
	}
}

// sealedWith reports whether resp is sealed and, if so, the id of the key
// its content type names.
func sealedWith(resp idempotency.StoredResponse) (keyID string, sealed bool) {
	mt, params, err := mime.ParseMediaType(resp.ContentType)
	if err != nil || mt != idempotency.SealedMediaType {
		return "", false
	}
	return params["key"], true
}
