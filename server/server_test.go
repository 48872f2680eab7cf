package server

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestNewErrors(t *testing.T) {
	mem := NewMemoryStorage().Storage()
	for _, tt := range []struct {
		name    string
		storage Storage
	}{
		{"no storage", Storage{}},
		{"no key store", Storage{Payments: mem.Payments, Charges: mem.Charges}},
		{"no payment store", Storage{Keys: mem.Keys, Charges: mem.Charges}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			srv, err := New(Config{Storage: tt.storage, Logger: testLogger(t)})
			if err == nil {
				srv.Close()
			}
			if err == nil || !strings.Contains(err.Error(), "Config.Storage needs Keys and Payments") {
				t.Errorf("New = %v, want an error naming Config.Storage's Keys and Payments", err)
			}
		})
	}
}

// TestNewChargesDefault checks that a Storage without Charges keeps the
// processor's charges in memory.
func TestNewChargesDefault(t *testing.T) {
	mem := NewMemoryStorage()
	storage := mem.Storage()
	storage.Charges = nil
	srv, err := New(Config{Storage: storage, APIKeys: testAPIKeys, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv)
	defer func() {
		hs.Close()
		srv.Close()
	}()
	ts := &testServer{Server: srv, URL: hs.URL, storage: storage, client: hs.Client()}
	if r := ts.mustSend(t, keyed("k", payment)); r.status != http.StatusCreated {
		t.Fatalf("%d %s", r.status, r.body)
	}
	if n := len(mem.Payments()); n != 1 {
		t.Errorf("%d payments, want 1", n)
	}
	if n := len(mem.Charges()); n != 0 {
		t.Errorf("%d charges in the given storage, want 0: it has no Charges", n)
	}
}

func TestServerRoutes(t *testing.T) {
	ts := newTestServer(t, memoryStorage(t), Config{})
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
	for _, want := range []string{"idem_keys_claimed_total 1", "idem_keys_completed_total 1", `idem_processor_charges_total{result="created"} 1`, "# TYPE idem_replays_total counter"} {
		if !strings.Contains(string(r.body), want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
}

func TestServerExternalProcessor(t *testing.T) {
	// A server that charges through another server's processor.
	charger := newTestServer(t, memoryStorage(t), Config{})
	ts := newTestServer(t, memoryStorage(t), Config{ProcessorURL: charger.ProcessorURL()})
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
