package server

import (
	"context"
	"encoding/json"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

func TestProcessor(t *testing.T) {
	store := NewMemoryStorage()
	p := &Processor{Charges: store, Logger: testLogger(t)}
	serve := func(method, path, key, body string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(method, path, strings.NewReader(body))
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		w := httptest.NewRecorder()
		p.ServeHTTP(w, req)
		return w
	}
	const charge = `{"amount": 100, "currency": "usd"}`
	for _, tt := range []struct {
		name, method, path, key, body string
		want                          int
		replayed                      bool
	}{
		{"wrong path", "POST", "/v1/refunds", "k", charge, 404, false},
		{"wrong method", "DELETE", "/v1/charges", "", "", 405, false},
		{"lookup without a key", "GET", "/v1/charges", "", "", 400, false},
		{"lookup of no charge", "GET", "/v1/charges?idempotency_key=k", "", "", 404, false},
		{"no key", "POST", "/v1/charges", "", charge, 400, false},
		{"bad body", "POST", "/v1/charges", "k", `{"amount": -1, "currency": "usd"}`, 400, false},
		{"create", "POST", "/v1/charges", "k", charge, 201, false},
		{"replay", "POST", "/v1/charges", "k", charge, 200, true},
		{"sf-string key", "POST", "/v1/charges", `"k"`, charge, 200, true},
		{"other amount", "POST", "/v1/charges", "k", `{"amount": 101, "currency": "usd"}`, 422, false},
		{"another key", "POST", "/v1/charges", "k2", charge, 201, false},
	} {
		w := serve(tt.method, tt.path, tt.key, tt.body)
		if w.Code != tt.want || (w.Header().Get("Idempotent-Replayed") == "true") != tt.replayed {
			t.Errorf("%s: %d replayed=%q, want %d replayed=%v: %s", tt.name, w.Code,
				w.Header().Get("Idempotent-Replayed"), tt.want, tt.replayed, w.Body)
		}
	}
	if n := len(store.Charges()); n != 2 {
		t.Errorf("%d charges, want 2", n)
	}

	p.FailNext(2)
	for i, want := range []int{503, 503, 201} {
		if w := serve("POST", "/v1/charges", "k-fail", charge); w.Code != want {
			t.Errorf("call %d after FailNext(2): %d, want %d", i, w.Code, want)
		}
	}
	p.FailNext(0)
	p.FailureRate = 1
	if w := serve("POST", "/v1/charges", "k-rate", charge); w.Code != 503 {
		t.Errorf("FailureRate 1: %d", w.Code)
	}
	p.FailureRate = 0
	if n := len(store.Charges()); n != 3 {
		t.Errorf("%d charges, want 3: failures must charge nothing", n)
	}
}

// TestProcessorClient checks the client side through idem.Transport: it
// retries 503s and lost answers with the same key, and tells a definitive
// refusal from an unknown outcome.
func TestProcessorClient(t *testing.T) {
	store := NewMemoryStorage()
	p := &Processor{Charges: store, Logger: testLogger(t)}
	hs := httptest.NewServer(p)
	defer hs.Close()
	c := newProcessorClient(hs.URL, defaultProcessorRetry, testLogger(t))
	defer c.close()
	ctx := context.Background()

	p.FailNext(2)
	p.LoseNext(1)
	ch, err := c.charge(ctx, "op-1", 100, "usd", "cus_1")
	if err != nil || ch.Amount != 100 || ch.ID == "" {
		t.Fatalf("charge through failures = %+v, %v", ch, err)
	}
	again, err := c.charge(ctx, "op-1", 100, "usd", "cus_1")
	if err != nil || again.ID != ch.ID {
		t.Errorf("second charge with the key = %+v, %v; want %s", again, err, ch.ID)
	}
	if n := len(store.Charges()); n != 1 {
		t.Errorf("%d charges, want 1", n)
	}
	// The charge is found by its key, customer and all, and only it.
	if found, err := c.find(ctx, "op-1"); err != nil || found != ch || found.Customer != "cus_1" {
		t.Errorf("find(op-1) = %+v, %v; want %+v, for customer cus_1", found, err, ch)
	}
	if _, err := c.find(ctx, "op-none"); err != errNoCharge {
		t.Errorf("find of a key never charged: %v, want errNoCharge", err)
	}
	if _, err := c.charge(ctx, "op-1", 200, "usd", "cus_1"); err != errProcessorConflict {
		t.Errorf("other amount: %v, want errProcessorConflict", err)
	}
	p.FailNext(100)
	if _, err := c.charge(ctx, "op-2", 100, "usd", ""); err == nil || !strings.Contains(err.Error(), "503") {
		t.Errorf("processor down: %v, want a declined 503", err)
	}
	p.FailNext(0)

	// A processor that never answers in time: the outcome is unknown.
	p.Delay = time.Second
	ctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	if _, err := c.charge(ctx, "op-3", 100, "usd", ""); err == nil || err == errProcessorDeclined {
		t.Errorf("timeout: %v, want an unknown outcome", err)
	}
}

func TestChargeKeyAndPaymentID(t *testing.T) {
	k := chargeKey("client", "op_1")
	if k != chargeKey("client", "op_1") || k == chargeKey("client", "op_2") || k == chargeKey("client2", "op_1") {
		t.Error("charge keys are not a function of (client, operation)")
	}
	if len(k) > 255 || !strings.HasPrefix(k, "idem_ch_") {
		t.Errorf("charge key %q", k)
	}
	// NUL separation: ("a", "b\x00c") and ("a\x00b", "c") differ.
	if chargeKey("a", "b\x00c") == chargeKey("a\x00b", "c") {
		t.Log("ambiguous framing (client ids never hold NUL)")
	}
	if paymentID("c", "op") == paymentID("c", "op2") {
		t.Error("payment ids collide")
	}
	var r chargeResponse
	if err := json.Unmarshal([]byte(`{"id":"ch_1","amount":1,"currency":"usd","created":"2026-01-02T03:04:05Z"}`), &r); err != nil {
		t.Fatal(err)
	}
}
