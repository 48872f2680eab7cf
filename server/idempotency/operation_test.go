package idempotency

import (
	"testing"
	"time"
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
