package server

import (
	"context"
	"math"
	"net/http"
	"strings"
	"testing"
	"time"
)

type keysOnly struct{ Store }

// stagedOnly keeps payments only in a key's unit of work.
type stagedOnly struct{ PaymentStore }

func TestNewErrors(t *testing.T) {
	mem := NewMemoryStore()
	for _, tt := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"no store", Config{}, "Store is nil"},
		{"no payment store", Config{Store: keysOnly{mem}}, "not a PaymentStore"},
		{"no payment inserter", Config{Store: mem, Payments: stagedOnly{mem}, NoIdempotency: true}, "PaymentInserter"},
		{"negative batch", Config{Store: mem, PurgeBatch: -1}, "negative"},
		{"duty cycle over 1", Config{Store: mem, PurgeDutyCycle: 1.5}, "PurgeDutyCycle"},
		{"negative duty cycle", Config{Store: mem, PurgeDutyCycle: -0.5}, "PurgeDutyCycle"},
		{"NaN duty cycle", Config{Store: mem, PurgeDutyCycle: math.NaN()}, "PurgeDutyCycle"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			tt.cfg.Logger = testLogger(t)
			srv, err := New(tt.cfg)
			if err == nil {
				srv.Close()
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("New = %v, want an error with %q", err, tt.want)
			}
		})
	}
}

func TestServerRoutes(t *testing.T) {
	ts := newTestServer(t, NewMemoryStore(), Config{})
	for _, tt := range []struct {
		c      call
		status int
		typ    string
	}{
		{call{method: "GET", path: "/healthz", token: "-"}, 200, ""},
		{call{method: "GET", path: "/metrics", token: "-"}, 200, ""},
		{call{method: "GET", path: "/nope", token: "-"}, 404, ProblemNotFound},
		{call{method: "GET", path: "/v1/nope"}, 404, ProblemNotFound},
		{call{method: "DELETE", path: "/v1/payments"}, 405, ProblemMethodNotAllowed},
		{call{method: "GET", path: "/v1/payments"}, 405, ProblemMethodNotAllowed},
		{call{method: "POST", path: "/v1/payments/pay_1", keys: []string{"k"}, body: "{}"}, 405, ProblemMethodNotAllowed},
	} {
		r := ts.mustSend(t, tt.c)
		if r.status != tt.status {
			t.Errorf("%s %s: %d, want %d", tt.c.method, tt.c.path, r.status, tt.status)
			continue
		}
		if tt.typ != "" && r.problem(t).Type != tt.typ {
			t.Errorf("%s %s: type %s", tt.c.method, tt.c.path, r.problem(t).Type)
		}
	}
	ts.mustSend(t, keyed("k1", payment))
	r := ts.mustSend(t, call{method: "GET", path: "/metrics", token: "-"})
	for _, want := range []string{"idem_keys_claimed_total 1", "idem_keys_completed_total 1", `idem_processor_charges_total{result="created"} 1`, "go_goroutines"} {
		if !strings.Contains(string(r.body), want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
}

// TestServerRun checks that the purge job runs at start and on every tick,
// and stops with its context.
func TestServerRun(t *testing.T) {
	store, clock := newClockedMemoryStore()
	ts := newTestServer(t, store, Config{Retention: time.Hour, PurgeInterval: 20 * time.Millisecond, PurgeBatch: 1})
	ts.mustSend(t, keyed("k1", payment))
	ts.mustSend(t, keyed("k2", payment))
	clock.Advance(2 * time.Hour)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- ts.Run(ctx) }()
	deadline := time.Now().Add(5 * time.Second)
	for ts.counter(t, "idem_keys_purged_total") < 2 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run = %v", err)
	}
	if got := ts.counter(t, "idem_keys_purged_total"); got != 2 {
		t.Errorf("purged %v keys, want 2", got)
	}
}

func TestServerExternalProcessor(t *testing.T) {
	// A server that charges through another server's processor.
	charger := newTestServer(t, NewMemoryStore(), Config{})
	ts := newTestServer(t, NewMemoryStore(), Config{ProcessorURL: charger.ProcessorURL()})
	if ts.ProcessorURL() != charger.ProcessorURL() {
		t.Fatalf("ProcessorURL = %s", ts.ProcessorURL())
	}
	if r := ts.mustSend(t, keyed("k", payment)); r.status != http.StatusCreated {
		t.Fatalf("%d %s", r.status, r.body)
	}
	if n := charger.charges.created.Load(); n != 1 {
		t.Errorf("the external processor made %d charges, want 1", n)
	}
}
