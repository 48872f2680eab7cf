package server

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/idemkit/idem/server/idempotency"
)

// testInvalidTextChargesNothing checks that text the payment would store is
// refused before the card is charged: invalid UTF-8 (raw or as an unpaired
// surrogate escape), NUL and the other control characters, in JSON and in
// forms. Each gets 400 invalid-request naming the field, nothing is
// charged, and the key stays free for the corrected body. Before, the
// charge was made and PostgreSQL refused the insert, leaving a charge
// without a payment and a key that answered 500 forever.
func testInvalidTextChargesNothing(t *testing.T, newStorage newStorageFunc) {
	ts := newTestServer(t, newStorage(t), Config{})
	const form = "application/x-www-form-urlencoded"
	for _, tt := range []struct {
		name, contentType, body string
		field                   string
	}{
		{"JSON NUL", "", `{"amount": 4200, "currency": "usd", "customer": "a\u0000b"}`, "customer"},
		{"JSON newline", "", `{"amount": 4200, "currency": "usd", "customer": "cus_1\nlevel=ERROR"}`, "customer"},
		{"JSON C1 control", "", `{"amount": 4200, "currency": "usd", "customer": "a\u0085b"}`, "customer"},
		{"JSON DEL", "", "{\"amount\": 4200, \"currency\": \"usd\", \"customer\": \"a\x7fb\"}", "customer"},
		{"JSON lone high surrogate", "", `{"amount": 4200, "currency": "usd", "customer": "caf\ud800"}`, "customer"},
		{"JSON lone low surrogate", "", `{"amount": 4200, "currency": "usd", "customer": "\udc00x"}`, "customer"},
		{"JSON NUL in currency", "", `{"amount": 4200, "currency": "us\u0000", "customer": "cus_123"}`, "currency"},
		{"form invalid UTF-8", form, "amount=4200&currency=usd&customer=caf%E9", "customer"},
		{"form NUL", form, "amount=4200&currency=usd&customer=a%00b", "customer"},
		{"form invalid UTF-8 in currency", form, "amount=4200&currency=%E9sd&customer=cus_123", "currency"},
		{"form control in currency", form, "amount=4200&currency=us%0A&customer=cus_123", "currency"},
	} {
		key := "k-" + strings.ReplaceAll(tt.name, " ", "-")
		t.Run(tt.name, func(t *testing.T) {
			ts.charges.created.Store(0)
			c := keyed(key, tt.body)
			c.contentType = tt.contentType
			r := ts.mustSend(t, c)
			if r.status != http.StatusBadRequest {
				t.Fatalf("status %d, want 400: %s", r.status, r.body)
			}
			p := r.problem(t)
			if p.Type != idempotency.ProblemInvalidRequest || len(p.Errors) != 1 || p.Errors[0].Field != tt.field {
				t.Errorf("problem %s %+v, want invalid-request with one error on %s", p.Type, p.Errors, tt.field)
			}
			if n := ts.charges.created.Load(); n != 0 {
				t.Fatalf("%d charges after an invalid body, want 0", n)
			}
			// The key is free: the corrected body is a new payment.
			if r := ts.mustSend(t, keyed(key, payment)); r.status != http.StatusCreated || r.replayed() {
				t.Errorf("corrected retry: %d replayed=%v %s", r.status, r.replayed(), r.body)
			}
		})
	}
	// Text that is unusual but valid is stored as sent, and read back.
	for _, customer := range []string{"café ☕", "cus_\U0001F600", `quote " and \ backslash`, strings.Repeat("é", maxCustomerLen/2)} {
		body := fmt.Sprintf(`{"amount": 4200, "currency": "usd", "customer": %q}`, customer)
		r := ts.mustSend(t, keyed("k-valid-"+fmt.Sprint(len(customer)), body))
		if r.status != http.StatusCreated || r.payment(t).Customer != customer {
			t.Fatalf("customer %q: %d %s", customer, r.status, r.body)
		}
		got := ts.mustSend(t, call{method: "GET", path: "/v1/payments/" + r.payment(t).ID})
		if got.status != http.StatusOK || got.payment(t).Customer != customer {
			t.Errorf("GET customer %q: %d %s", customer, got.status, got.body)
		}
	}
}

// testGetMalformedID checks that GET /v1/payments/{id} answers 404 for an
// id that cannot be a payment's, with NUL or invalid UTF-8 among them,
// without asking the store: PostgreSQL answered 500 to those.
func testGetMalformedID(t *testing.T, newStorage newStorageFunc) {
	ts := newTestServer(t, newStorage(t), Config{})
	p := ts.mustSend(t, keyed("k-get", payment)).created(t, "k-get")
	for _, id := range []string{
		"%00", "pay_%00", p.ID + "%00", "caf%E9", p.ID[:len(p.ID)-1] + "%E9", "%C0%80",
		strings.ToUpper(p.ID), p.ID + "0", "pay_", strings.Repeat("x", 300),
	} {
		r := ts.mustSend(t, call{method: "GET", path: "/v1/payments/" + id})
		if r.status != http.StatusNotFound || r.problem(t).Type != ProblemNotFound {
			t.Errorf("GET /v1/payments/%s: %d %s, want 404", id, r.status, r.body)
		}
	}
	if r := ts.mustSend(t, call{method: "GET", path: "/v1/payments/" + p.ID}); r.status != http.StatusOK {
		t.Errorf("GET the payment: %d %s", r.status, r.body)
	}
}
