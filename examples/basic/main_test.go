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

// TestBasic builds the example and runs it as a user would: on its own, and
// against a server given with -url.
func TestBasic(t *testing.T) {
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the go command is needed to build the example: %v", err)
	}
	bin := filepath.Join(t.TempDir(), "basic")
	if out, err := exec.Command(goTool, "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}

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

	for name, args := range map[string][]string{
		"standalone": nil,
		"with -url":  {"-url", hs.URL},
	} {
		t.Run(name, func(t *testing.T) {
			out, err := exec.CommandContext(t.Context(), bin, args...).CombinedOutput()
			if err != nil {
				t.Fatalf("basic %s: %v\n%s", strings.Join(args, " "), err, out)
			}
			status, body, _ := strings.Cut(string(out), "\n")
			key := `[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}`
			if !regexp.MustCompile(`^201 Created Idempotency-Key: ` + key + `$`).MatchString(status) {
				t.Errorf("first line %q, want 201 Created and the key sent", status)
			}
			var p struct {
				ID     string `json:"id"`
				Amount int64  `json:"amount"`
			}
			if err := json.Unmarshal([]byte(body), &p); err != nil || !strings.HasPrefix(p.ID, "pay_") || p.Amount != 4200 {
				t.Fatalf("payment %q: %+v, %v", body, p, err)
			}
			if args != nil { // the payment must be on the server given with -url
				req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, hs.URL+"/v1/payments/"+p.ID, nil)
				req.Header.Set("Authorization", "Bearer sk_test_demo")
				resp, err := hs.Client().Do(req)
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					t.Errorf("GET /v1/payments/%s on the -url server: %s", p.ID, resp.Status)
				}
			}
		})
	}
}
