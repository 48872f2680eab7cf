package main

import (
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/idemkit/idem/server"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// keyPattern is a UUIDv4 as idem.NewKey writes it.
const keyPattern = `[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}`

// buildBasic builds the example once per test.
func buildBasic(t *testing.T) string {
	t.Helper()
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the go command is needed to build the example: %v", err)
	}
	bin := filepath.Join(t.TempDir(), "basic")
	if out, err := exec.Command(goTool, "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// payment is what a run of the example printed: the key it stored before
// the call, the status line with the key the server echoed and whether it
// was a replay, and the payment.
type payment struct {
	key, status string
	ID          string `json:"id"`
	Amount      int64  `json:"amount"`
}

// runBasic runs the example with args and parses what it printed.
func runBasic(t *testing.T, bin string, args ...string) payment {
	t.Helper()
	out, err := exec.CommandContext(t.Context(), bin, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("basic %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	lines := strings.SplitN(string(out), "\n", 3)
	if len(lines) < 3 {
		t.Fatalf("basic %s printed %q, want the key, the status and the payment", strings.Join(args, " "), out)
	}
	m := regexp.MustCompile(`^payment key: (` + keyPattern + `)$`).FindStringSubmatch(lines[0])
	if m == nil {
		t.Fatalf("first line %q, want the payment key, stored before the call", lines[0])
	}
	p := payment{key: m[1], status: lines[1]}
	if err := json.Unmarshal([]byte(lines[2]), &p); err != nil || !strings.HasPrefix(p.ID, "pay_") || p.Amount != 4200 {
		t.Fatalf("payment %q: %+v, %v", lines[2], p, err)
	}
	return p
}

// TestBasic builds the example and runs it as a user would: on its own,
// against a server given with -url, and again with the key the first run
// stored, which gets the same payment back.
func TestBasic(t *testing.T) {
	bin := buildBasic(t)
	srv, err := server.New(server.Config{
		Storage: server.NewMemoryStorage().Storage(),
		APIKeys: map[string]string{"sk_test_demo": "demo"},
		Logger:  slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv)
	t.Cleanup(func() {
		hs.Close()
		srv.Close()
	})

	t.Run("standalone", func(t *testing.T) {
		p := runBasic(t, bin)
		if want := "201 Created Idempotency-Key: " + p.key; p.status != want {
			t.Errorf("status line %q, want %q: the stored key sent", p.status, want)
		}
	})

	first := runBasic(t, bin, "-url", hs.URL)
	if want := "201 Created Idempotency-Key: " + first.key; first.status != want {
		t.Errorf("status line %q, want %q: the stored key sent", first.status, want)
	}
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, hs.URL+"/v1/payments/"+first.ID, nil)
	req.Header.Set("Authorization", "Bearer sk_test_demo")
	resp, err := hs.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("GET /v1/payments/%s on the -url server: %s", first.ID, resp.Status)
	}

	// The call retried later, with the key stored with the order: the
	// same payment, replayed, not a second one.
	again := runBasic(t, bin, "-url", hs.URL, "-key", first.key)
	if want := "201 Created Idempotency-Key: " + first.key + " (replayed)"; again.key != first.key || again.status != want || again.ID != first.ID {
		t.Errorf("run with -key %s: key %s, %q, payment %s; want the key, %q and payment %s",
			first.key, again.key, again.status, again.ID, want, first.ID)
	}
}

// TestBasicDeadline runs the example against a server that never answers:
// the operation's deadline (-deadline, on the context) ends it, and it
// says which key to retry with.
func TestBasicDeadline(t *testing.T) {
	bin := buildBasic(t)
	release := make(chan struct{})
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-release:
		}
	}))
	t.Cleanup(func() {
		close(release)
		hs.Close()
	})
	out, err := exec.CommandContext(t.Context(), bin, "-url", hs.URL, "-deadline", "1s").CombinedOutput() // long enough to connect on a busy machine
	if err == nil {
		t.Fatalf("basic against a server that never answers succeeded:\n%s", out)
	}
	m := regexp.MustCompile(`^payment key: (` + keyPattern + `)\n`).FindStringSubmatch(string(out))
	if m == nil {
		t.Fatalf("output %q lacks the stored key", out)
	}
	for _, want := range []string{"outcome unknown: run again with -key " + m[1], "context deadline exceeded"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}
