package main

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/pgtest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// syncBuffer is a bytes.Buffer safe for the server's and the test's
// goroutines.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

var listeningRE = regexp.MustCompile(`msg=listening addr=(\S+)`)

// start runs the server with args and env and returns its base URL and a
// stop function that cancels it and returns run's error.
func start(t *testing.T, args []string, env map[string]string) (string, *syncBuffer, func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	out := &syncBuffer{}
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, append([]string{"-addr", "127.0.0.1:0"}, args...), func(k string) string { return env[k] }, out)
	}()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if m := listeningRE.FindStringSubmatch(out.String()); m != nil {
			stopped := false
			var err error
			stop := func() error {
				if !stopped {
					stopped = true
					cancel()
					err = <-done
				}
				return err
			}
			t.Cleanup(func() { stop() })
			return "http://" + m[1], out, stop
		}
		select {
		case err := <-done:
			cancel()
			t.Fatalf("run ended before listening: %v\n%s", err, out)
		default:
		}
		if time.Now().After(deadline) {
			cancel()
			t.Fatalf("server did not start:\n%s", out)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func post(t *testing.T, client *http.Client, url, token, key, body string) (*http.Response, string) {
	t.Helper()
	resp, b, err := tryPost(client, url, token, key, body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, b
}

func tryPost(client *http.Client, url, token, key, body string) (*http.Response, string, error) {
	req, _ := http.NewRequest("POST", url+"/v1/payments", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp, string(b), err
}

func TestRunInMemory(t *testing.T) {
	url, out, stop := start(t, nil, nil)
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}

	const body = `{"amount": 4200, "currency": "usd", "customer": "cus_123"}`
	resp, b := post(t, client, url, "sk_test_demo", "k1", body)
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("POST: %d %s", resp.StatusCode, b)
	}
	resp, b2 := post(t, client, url, "sk_test_demo", "k1", body)
	if resp.Header.Get("Idempotent-Replayed") != "true" || b2 != b {
		t.Errorf("retry: %d %s, want the replay", resp.StatusCode, b2)
	}
	for path, want := range map[string]string{"/healthz": "ok", "/metrics": "idem_keys_claimed_total 1"} {
		resp, err := client.Get(url + path)
		if err != nil {
			t.Fatal(err)
		}
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(string(got), want) {
			t.Errorf("GET %s: %d, want %q in the body", path, resp.StatusCode, want)
		}
	}
	if err := stop(); err != nil {
		t.Fatalf("run: %v", err)
	}
	logs := out.String()
	for _, want := range []string{"in-memory store", "sk_test_demo:demo", "msg=stopped"} {
		if !strings.Contains(logs, want) {
			t.Errorf("log lacks %q:\n%s", want, logs)
		}
	}
	if strings.Contains(logs, "cus_123") {
		t.Error("the log holds a request body")
	}
}

// TestRunGracefulStop stops the server while a payment is in flight: the
// payment finishes and is answered, and its key is completed, not left
// started.
func TestRunGracefulStop(t *testing.T) {
	url, _, stop := start(t, []string{"-processor-delay", "300ms", "-api-keys", "tok_1:acme"}, nil)
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	type result struct {
		status int
		body   string
		err    error
	}
	done := make(chan result)
	go func() {
		resp, b, err := tryPost(client, url, "tok_1", "k-inflight", `{"amount": 1, "currency": "usd", "customer": "c"}`)
		if err != nil {
			done <- result{err: err}
			return
		}
		done <- result{resp.StatusCode, b, nil}
	}()
	time.Sleep(100 * time.Millisecond) // the request is at the processor
	stopped := make(chan error)
	go func() { stopped <- stop() }()
	r := <-done
	if r.err != nil || r.status != http.StatusCreated {
		t.Errorf("in-flight payment during shutdown: %d %s %v", r.status, r.body, r.err)
	}
	if err := <-stopped; err != nil {
		t.Errorf("run: %v", err)
	}
}

func TestRunFlags(t *testing.T) {
	for _, tt := range []struct {
		name string
		args []string
		env  map[string]string
		want string
	}{
		{"bad api keys", []string{"-api-keys", "nocolon"}, nil, "not token:client_id"},
		{"bad api keys from env", nil, map[string]string{"IDEM_API_KEYS": ":x"}, "not token:client_id"},
		{"unknown flag", []string{"-nope"}, nil, "flag provided but not defined"},
		{"extra argument", []string{"serve"}, nil, "unexpected arguments"},
		{"lock timeout over retention", []string{"-lock-timeout", "2h", "-retention", "1h"}, nil, "shorter than -retention"},
		{"processor slower than the lock timeout", []string{"-processor-delay", "2s", "-lock-timeout", "1s"}, nil, "shorter than -lock-timeout"},
		{"failure rate", []string{"-processor-failure-rate", "2"}, nil, "[0, 1]"},
		{"log format", []string{"-log-format", "xml"}, nil, "text or json"},
		{"bad database URL", []string{"-database-url", "postgres://%zz"}, nil, "database"},
		{"database from env", nil, map[string]string{"DATABASE_URL": "postgres://%zz"}, "database"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var out bytes.Buffer
			err := run(context.Background(), tt.args, func(k string) string { return tt.env[k] }, &out)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("run(%q) = %v, want an error with %q", tt.args, err, tt.want)
			}
		})
	}
}

// TestRunPostgres runs the binary's code on PostgreSQL: it migrates the
// schema at start and serves payments from it.
func TestRunPostgres(t *testing.T) {
	dsn := pgtest.SchemaURL(t)
	url, out, stop := start(t, nil, map[string]string{"DATABASE_URL": dsn})
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	const body = `{"amount": 4200, "currency": "usd", "customer": "cus_123"}`
	resp, b := post(t, client, url, "sk_test_demo", "k-pg", body)
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("POST: %d %s", resp.StatusCode, b)
	}
	resp, b2 := post(t, client, url, "sk_test_demo", "k-pg", body)
	if resp.Header.Get("Idempotent-Replayed") != "true" || b2 != b {
		t.Errorf("retry: %d %s, want the replay", resp.StatusCode, b2)
	}
	if err := stop(); err != nil {
		t.Fatalf("run: %v", err)
	}
	if logs := out.String(); !strings.Contains(logs, "using PostgreSQL") || strings.Contains(logs, "in-memory") {
		t.Errorf("log does not say PostgreSQL:\n%s", logs)
	}
	// A second start on the same schema migrates nothing and still serves
	// the stored outcome.
	url, _, stop = start(t, []string{"-database-url", dsn}, nil)
	resp, b3 := post(t, client, url, "sk_test_demo", "k-pg", body)
	if resp.Header.Get("Idempotent-Replayed") != "true" || b3 != b {
		t.Errorf("after a restart: %d %s, want the replay", resp.StatusCode, b3)
	}
	if err := stop(); err != nil {
		t.Fatalf("run: %v", err)
	}
}
