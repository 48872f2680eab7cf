package storetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"strings"
	"testing"

	"github.com/idemkit/idem/server/idempotency"
)

// invalidTexts are values no store keeps as text (PostgreSQL refuses them
// with SQLSTATE 22021), each with the values a store that mangled it
// instead of refusing it would have kept.
var invalidTexts = []struct {
	name    string
	value   string
	mangled []string
}{
	{"NUL", "a\x00b", []string{"a", "ab", "a b"}},
	{"NUL only", "\x00", []string{"", " "}},
	{"invalid UTF-8", "caf\xe9", []string{"caf", "café", "caf\uFFFD"}},
	{"lone continuation byte", "x\x80y", []string{"xy", "x\uFFFDy"}},
	{"surrogate half", "\xed\xa0\x80", []string{"", "\uFFFD"}},
}

// testClaimInvalidText claims keys whose client, key, method or path is not
// valid text: each claim fails with an error wrapping ErrInvalidText and
// stores nothing, neither the value nor a mangled form of it.
func testClaimInvalidText(t *testing.T, b Backend) {
	for i, bad := range invalidTexts {
		for _, field := range []string{"client", "key", "method", "path"} {
			t.Run(fmt.Sprintf("%s/%s", field, bad.name), func(t *testing.T) {
				// A client and key of their own: the probes below claim
				// the mangled forms, which several values share.
				base := request(fmt.Sprintf("cli_%s_%d", field, i), fmt.Sprintf("key-%s-%d", field, i), "a")
				set := func(v string) idempotency.ClaimRequest {
					req := base
					switch field {
					case "client":
						req.ClientID = v
					case "key":
						req.Key = v
					case "method":
						req.Method = v
					case "path":
						req.Path = v
					}
					return req
				}
				res, err := b.Store.Claim(context.Background(), set(bad.value))
				if !errors.Is(err, idempotency.ErrInvalidText) {
					t.Fatalf("Claim with %s %q = %+v, %v; want an error wrapping ErrInvalidText", field, bad.value, res, err)
				}
				// Nothing kept under a mangled client or key; for the
				// method and path, nothing kept under the request's key.
				probes := bad.mangled
				if field == "method" || field == "path" {
					probes = []string{"POST"}
				}
				for _, v := range probes {
					req := set(v)
					if field == "method" || field == "path" {
						req = base
					}
					res, err := b.Store.Claim(context.Background(), req)
					if err != nil {
						continue // a mangled form may be invalid itself
					}
					if res.Outcome != idempotency.Claimed {
						t.Errorf("after the refused claim, %s %q: %s (record %+v), want Claimed: the refused claim stored something",
							field, v, res.Outcome, res.Record)
					}
				}
			})
		}
	}
}

// testClaimKeyLength claims keys of 0 and 256 bytes, in a commit of their
// own and in one transaction: each claim fails with an error wrapping
// ErrInvalidKey and stores nothing; keys of 1 and 255 bytes are claimed and
// kept exactly.
func testClaimKeyLength(t *testing.T, b Backend) {
	long := strings.Repeat("k", 254)
	for _, oneTx := range []bool{false, true} {
		s := b.Store
		if _, ok := s.(idempotency.TxClaimer); ok && oneTx {
			s = inTx(s)
		}
		for _, bad := range []string{"", long + "kk", long + "é"} {
			req := request("cli_a", bad, "a")
			if res, err := s.Claim(context.Background(), req); !errors.Is(err, idempotency.ErrInvalidKey) {
				t.Errorf("Claim (one transaction: %v) of a key of %d bytes = %+v, %v; want an error wrapping ErrInvalidKey",
					oneTx, len(bad), res, err)
			}
		}
	}
	// Nothing kept under the longest key: its first 255 bytes are a new key.
	for _, good := range []string{"k", long + "k"} {
		req := request("cli_a", good, "a")
		c := claim(t, b.Store, req, idempotency.Claimed).Claim
		if c.Key != good {
			t.Errorf("claim of a key of %d bytes names a key of %d", len(good), len(c.Key))
		}
		if err := complete(t, b, c, created(good)); err != nil {
			t.Fatalf("Complete of a key of %d bytes: %v", len(good), err)
		}
		if rec := claim(t, b.Store, req, idempotency.Exists).Record; rec.Key != good || rec.Response == nil {
			t.Errorf("record of a key of %d bytes: %+v", len(good), rec)
		}
	}
}

// testClaimUnicodeText claims a key whose client, key and path hold valid
// non-ASCII text: it is kept, and returned, exactly.
func testClaimUnicodeText(t *testing.T, b Backend) {
	req := request("clïent-日本", "kéy-✓", "a")
	req.Path = "/v1/cafés/\U0001F600"
	c := claim(t, b.Store, req, idempotency.Claimed).Claim
	if c.ClientID != req.ClientID || c.Key != req.Key {
		t.Errorf("claim %+v, want client %q and key %q", c, req.ClientID, req.Key)
	}
	rec := claim(t, b.Store, req, idempotency.Exists).Record
	if rec.ClientID != req.ClientID || rec.Key != req.Key || rec.Path != req.Path {
		t.Errorf("record names %q %q %q, want %q %q %q", rec.ClientID, rec.Key, rec.Path, req.ClientID, req.Key, req.Path)
	}
	resp := idempotency.StoredResponse{
		Status:      201,
		ContentType: "text/plain; charset=utf-8",
		Header:      map[string]string{"Location": "/v1/cafés/1", "X-Note": "naïve ✓"},
		Body:        []byte("café"),
	}
	if err := complete(t, b, c, resp); err != nil {
		t.Fatalf("Complete with non-ASCII headers: %v", err)
	}
	got := claim(t, b.Store, req, idempotency.Exists).Record.Response
	if got == nil || got.ContentType != resp.ContentType || !maps.Equal(got.Header, resp.Header) || !bytes.Equal(got.Body, resp.Body) {
		t.Errorf("stored response %+v, want %+v", got, resp)
	}
}

// testCompleteInvalidText completes keys with a response whose content type
// or a header (name or value) is not valid text: Complete fails with an
// error wrapping ErrInvalidText, commits nothing of the unit of work, and
// leaves the key started; a valid response then completes it.
func testCompleteInvalidText(t *testing.T, b Backend) {
	ctx := context.Background()
	for i, resp := range []idempotency.StoredResponse{
		{Status: 201, ContentType: "text/plain; charset=\xff"},
		{Status: 201, ContentType: "application/json", Header: map[string]string{"Location": "/v1/orders/\x00"}},
		{Status: 201, ContentType: "application/json", Header: map[string]string{"Location": "/v1/caf\xe9"}},
		{Status: 201, ContentType: "application/json", Header: map[string]string{"X-\xff": "1"}},
	} {
		key := fmt.Sprintf("key-%d", i)
		req := request("cli_a", key, "a")
		c := claim(t, b.Store, req, idempotency.Claimed).Claim
		tx, wctx := begin(t, b, c)
		if err := b.Write(wctx, key+"-w"); err != nil {
			t.Fatal(err)
		}
		if err := tx.Complete(ctx, resp); !errors.Is(err, idempotency.ErrInvalidText) {
			t.Errorf("Complete with %+v: %v, want an error wrapping ErrInvalidText", resp, err)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Errorf("Rollback after a refused Complete: %v", err)
		}
		mustBeWritten(t, b, key+"-w", false)
		if st := status(t, b.Store, req); st != idempotency.StatusStarted {
			t.Errorf("key of a refused completion: status %q, want started", st)
		}
		if err := complete(t, b, c, created(key), key+"-w2"); err != nil {
			t.Errorf("Complete with a valid response after the refused one: %v", err)
		}
		mustBeWritten(t, b, key+"-w2", true)
	}
}
