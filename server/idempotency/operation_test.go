package idempotency

import (
	"encoding/binary"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
)

// TestOperationID checks that a claim request's operation ID is derived
// from the client, the key, the fingerprint and the first-sent time (to
// the second) and from nothing else, and that the derivation stays as it
// is: replicas of two releases must derive the same ID for one operation,
// or a downstream keyed by it would charge twice across a deploy.
func TestOperationID(t *testing.T) {
	sent := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	base := ClaimRequest{ClientID: "cli_a", Key: "k1", Method: "POST", Path: "/v1/payments",
		Fingerprint: []byte("fp"), FirstSent: FirstSentCheck{Sent: sent}}
	const golden = "1766663e-42c4-5aa6-98b5-b0f8602ad785"
	if got := base.OperationID(); got != golden {
		t.Errorf("OperationID() = %s, want %s: the derivation changed, and with it every downstream key", got, golden)
	}

	same := map[string]func(*ClaimRequest){
		"lease and retention": func(r *ClaimRequest) { r.LockTimeout, r.Retention = time.Second, time.Hour },
		"first-sent checks":   func(r *ClaimRequest) { r.FirstSent.Stale, r.FirstSent.EarliestBegin = true, sent },
		"sub-second sent":     func(r *ClaimRequest) { r.FirstSent.Sent = sent.Add(999 * time.Millisecond) },
		"sent's zone":         func(r *ClaimRequest) { r.FirstSent.Sent = sent.In(time.FixedZone("x", 3600)) },
	}
	for name, change := range same {
		r := base
		change(&r)
		if r.OperationID() != golden {
			t.Errorf("%s changed the operation ID", name)
		}
	}
	other := map[string]func(*ClaimRequest){
		"client":      func(r *ClaimRequest) { r.ClientID = "cli_b" },
		"key":         func(r *ClaimRequest) { r.Key = "k2" },
		"fingerprint": func(r *ClaimRequest) { r.Fingerprint = []byte("fq") },
		"first sent":  func(r *ClaimRequest) { r.FirstSent.Sent = sent.Add(time.Second) },
		"none sent":   func(r *ClaimRequest) { r.FirstSent.Sent = time.Time{} },
		// The fields are delimited: moving a byte from one to the next
		// is another operation.
		"client|key": func(r *ClaimRequest) { r.ClientID, r.Key = "cli_ak", "1" },
	}
	seen := map[string]string{golden: "base"}
	for name, change := range other {
		r := base
		change(&r)
		id := r.OperationID()
		if prev, dup := seen[id]; dup {
			t.Errorf("%s derived the operation ID of %s (%s)", name, prev, id)
		}
		seen[id] = name
	}
}

// TestOperationIDIsUUIDv5 checks the derivation against google/uuid's
// version 5 UUIDs, for fields short enough to hash on the stack and for
// longer ones.
func TestOperationIDIsUUIDv5(t *testing.T) {
	sent := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	for _, req := range []ClaimRequest{
		{ClientID: "cli_a", Key: "k1", Fingerprint: []byte("fp")},
		{ClientID: "cli_a", Key: "k1", Fingerprint: []byte("fp"), FirstSent: FirstSentCheck{Sent: sent}},
		{ClientID: strings.Repeat("c", 400), Key: strings.Repeat("k", 255), Fingerprint: make([]byte, 32),
			FirstSent: FirstSentCheck{Sent: sent}},
	} {
		var b []byte
		for _, f := range [][]byte{[]byte(req.ClientID), []byte(req.Key), req.Fingerprint} {
			b = binary.AppendUvarint(b, uint64(len(f)))
			b = append(b, f...)
		}
		if !req.FirstSent.Sent.IsZero() {
			b = binary.AppendVarint(b, req.FirstSent.Sent.Unix())
		}
		if got, want := req.OperationID(), uuid.NewSHA1(operationSpace, b).String(); got != want {
			t.Errorf("OperationID() of a %d-byte client id = %s, want uuid.NewSHA1's %s", len(req.ClientID), got, want)
		}
	}
}

// TestOperationIDSameOnEveryReplica serves one request on replicas with
// different options, each with a store of its own, as when the key's row
// was lost in a failover and the retry lands on another replica: every
// replica must derive the operation ID the first one did, or a downstream
// keyed by it charges twice. The request has a repeated query field out of
// order, which replicas on two canonical forms once fingerprinted, and so
// derived, differently.
func TestOperationIDSameOnEveryReplica(t *testing.T) {
	sent := time.Now().Add(-time.Minute).Truncate(time.Second)
	const path, body = "/v1/payments?expand=charge&amount=5000&amount=100", `{"currency": "usd", "amount": 4200}`
	fp, err := Fingerprint(http.MethodPost, "/v1/payments", "expand=charge&amount=5000&amount=100", "application/json", []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	want := ClaimRequest{ClientID: "c", Key: "k", Fingerprint: fp, FirstSent: FirstSentCheck{Sent: sent}}.OperationID()
	replicas := map[string]Options{
		"defaults":             {},
		"lease and retention":  {LockTimeout: time.Second, Retention: time.Hour},
		"keys never expire":    {Retention: -1},
		"no first-sent policy": {IgnoreFirstSent: true},
		"first-sent allowance": {FirstSentSkew: 2 * time.Second},
		"body as JSON":         {BodyFormat: BodyAsJSON},
		"JSON only":            {BodyFormat: BodyJSONOnly},
		"one transaction":      {OneTransaction: true},
		"stored 5xx, waits":    {StoreServerErrors: true, WaitForCompletion: time.Second},
		"body limit, retry":    {MaxBodyBytes: 1 << 10, RetryAfter: 5 * time.Second},
		"stored headers, size": {StoredHeaders: []string{"Location"}, MaxStoredBodyBytes: 1 << 10},
	}
	for name, opts := range replicas {
		var got string
		h := testHandler(t, NewMemoryStore(), opts, func(w http.ResponseWriter, r *http.Request) {
			c, _ := ClaimFromContext(r.Context())
			got = c.OperationID
			w.WriteHeader(http.StatusCreated)
		})
		req := call{path: path, keys: []string{"k"}, body: body}.request(t, "")
		req.Header.Set(DefaultFirstSentHeader, sent.UTC().Format(http.TimeFormat))
		if r := serveRequest(t, h, req); r.status != http.StatusCreated {
			t.Fatalf("%s: %d %s, want 201", name, r.status, r.body)
		}
		if got != want {
			t.Errorf("%s: operation %s, want %s, as every other replica", name, got, want)
		}
	}
}
