package main

import (
	"bytes"
	"context"
	"encoding/base64"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/pgtest"
)

// keyFile writes a seal key file of content with mode perm and returns its
// path.
func keyFile(t *testing.T, content string, perm os.FileMode) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "seal.keys")
	if err := os.WriteFile(path, []byte(content), perm); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, perm); err != nil { // past the umask
		t.Fatal(err)
	}
	return path
}

func b64(v byte) string { return base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{v}, 32)) }

// TestRunSealKeyFile starts the server on PostgreSQL with -seal-key-file:
// it logs the sealing key and the opening ones, seals what it stores,
// replays it, and after a rotation (a new key first) still replays what
// the old key sealed.
func TestRunSealKeyFile(t *testing.T) {
	dsn := pgtest.SchemaURL(t)
	url, out, stop := start(t, []string{"-database-url", dsn, "-seal-key-file", keyFile(t, "# keys\n2026-01 "+b64(1)+"\n", 0o600)}, nil)
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	const body = `{"amount": 4200, "currency": "usd", "customer": "cus_123"}`
	resp, first := post(t, client, url, "sk_test_demo", "k-sealed", body)
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("POST: %d %s", resp.StatusCode, first)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	logs := out.String()
	if !strings.Contains(logs, "sealing_key=2026-01") || strings.Contains(logs, "chmod") || strings.Contains(logs, b64(1)) {
		t.Errorf("log:\n%s\nwant the sealing key named, no warning about the file, no secret", logs)
	}
	conn, err := pgx.Connect(context.Background(), dsn) // the server's schema
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var ct string
	if err := conn.QueryRow(context.Background(),
		`SELECT response_content_type FROM idempotency_keys WHERE idempotency_key = 'k-sealed'`).Scan(&ct); err != nil {
		t.Fatal(err)
	}
	if ct != "application/vnd.idemkit.sealed; key=2026-01" {
		t.Errorf("stored content type %q, want sealed with 2026-01", ct)
	}

	rotated := keyFile(t, "2026-02 "+b64(2)+"\n2026-01 "+b64(1)+"\n", 0o644)
	url, out, stop = start(t, []string{"-database-url", dsn, "-seal-key-file", rotated, "-seal-key-file-insecure"}, nil)
	resp, again := post(t, client, url, "sk_test_demo", "k-sealed", body)
	if resp.Header.Get("Idempotent-Replayed") != "true" || again != first {
		t.Errorf("replay after the rotation: %d %s, want %s", resp.StatusCode, again, first)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if logs := out.String(); !strings.Contains(logs, "sealing_key=2026-02 opening_keys=2026-02,2026-01") || !strings.Contains(logs, "chmod 600") {
		t.Errorf("log:\n%s\nwant the rotated keys and a warning about the readable file (-seal-key-file-insecure)", logs)
	}
}

// TestRunSealKeyFileRefused: a key file that is missing or malformed stops
// the server at start, naming the flag and the line.
func TestRunSealKeyFileRefused(t *testing.T) {
	for _, tt := range []struct {
		name, path, want string
	}{
		{"missing", filepath.Join(t.TempDir(), "none"), "no such file"},
		{"empty", keyFile(t, "", 0o600), "no key"},
		{"short key", keyFile(t, "k1 AAAA\n", 0o600), "line 1"},
		{"duplicate", keyFile(t, "k1 "+b64(1)+"\n# c\nk1 "+b64(2)+"\n", 0o600), "line 3"},
		{"group-readable", keyFile(t, "k1 "+b64(0xfb)+"\n", 0o640), "mode 0640 lets its group or others read the keys"},
		{"world-readable", keyFile(t, "k1 "+b64(0xfb)+"\n", 0o604), "or start with -seal-key-file-insecure"},
		{"columns swapped", keyFile(t, b64(0xfb)+" 2026-01\n", 0o600), "line 1, column 2"},
		{"key pasted twice", keyFile(t, b64(0xfb)+" "+b64(0xfb)+"\n", 0o600), "line 1, column 1"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var out bytes.Buffer
			err := run(context.Background(), []string{"-addr", "127.0.0.1:0", "-seal-key-file", tt.path}, func(string) string { return "" }, &out)
			if err == nil || !strings.Contains(err.Error(), "-seal-key-file "+tt.path) || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("run = %v, want an error naming -seal-key-file and %q", err, tt.want)
			}
			if secret := b64(0xfb); strings.Contains(err.Error(), secret[:8]) || strings.Contains(out.String(), secret[:8]) {
				t.Errorf("run = %v, log:\n%s\nshows the secret", err, out.String())
			}
		})
	}
}

// TestRunSealKeyFileOwnerOnly: a key file only its owner may read (0600,
// 0400) starts the server without a warning; a readable one starts only
// with -seal-key-file-insecure, which logs it.
func TestRunSealKeyFileOwnerOnly(t *testing.T) {
	for _, perm := range []os.FileMode{0o600, 0o400} {
		_, out, stop := start(t, []string{"-seal-key-file", keyFile(t, "k1 "+b64(1)+"\n", perm)}, nil)
		if err := stop(); err != nil {
			t.Fatalf("mode %04o: %v", perm, err)
		}
		if logs := out.String(); strings.Contains(logs, "level=WARN msg=\"the seal key file") || !strings.Contains(logs, "sealing_key=k1") {
			t.Errorf("mode %04o: log:\n%s\nwant the keys, no warning", perm, logs)
		}
	}
	_, out, stop := start(t, []string{"-seal-key-file", keyFile(t, "k1 "+b64(1)+"\n", 0o644), "-seal-key-file-insecure"}, nil)
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if logs := out.String(); !strings.Contains(logs, "mode=0644") || !strings.Contains(logs, "-seal-key-file-insecure") {
		t.Errorf("log:\n%s\nwant a warning naming the mode and the flag", logs)
	}
}

// TestRunSealRequire: a response stored in the clear (before sealing was
// turned on) is replayed by a server that seals, and refused, 500 and
// nothing run, by one with -seal-require; a sealed one replays under
// both.
func TestRunSealRequire(t *testing.T) {
	dsn := pgtest.SchemaURL(t)
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	const body = `{"amount": 4200, "currency": "usd", "customer": "cus_123"}`
	url, _, stop := start(t, []string{"-database-url", dsn}, nil)
	resp, clear := post(t, client, url, "sk_test_demo", "k-clear", body)
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("POST: %d %s", resp.StatusCode, clear)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	keys := keyFile(t, "k1 "+b64(1)+"\n", 0o600)
	url, _, stop = start(t, []string{"-database-url", dsn, "-seal-key-file", keys}, nil)
	if resp, again := post(t, client, url, "sk_test_demo", "k-clear", body); resp.StatusCode != http.StatusCreated || again != clear {
		t.Errorf("the clear response while sealing, without -seal-require: %d %s, want it replayed", resp.StatusCode, again)
	}
	resp, sealed := post(t, client, url, "sk_test_demo", "k-sealed", body)
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("POST: %d %s", resp.StatusCode, sealed)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	url, out, stop := start(t, []string{"-database-url", dsn, "-seal-key-file", keys, "-seal-require"}, nil)
	resp, again := post(t, client, url, "sk_test_demo", "k-clear", body)
	if resp.StatusCode != http.StatusInternalServerError || strings.Contains(again, "cus_123") {
		t.Errorf("the clear response with -seal-require: %d %s, want 500 and nothing of it", resp.StatusCode, again)
	}
	if resp, again := post(t, client, url, "sk_test_demo", "k-sealed", body); resp.StatusCode != http.StatusCreated || again != sealed {
		t.Errorf("the sealed response with -seal-require: %d %s, want it replayed", resp.StatusCode, again)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if logs := out.String(); !strings.Contains(logs, "unsealed_replayed=false") || !strings.Contains(logs, "is stored in the clear") {
		t.Errorf("log:\n%s\nwant -seal-require said at start, and the refusal", logs)
	}
	conn, err := pgx.Connect(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var n int
	if err := conn.QueryRow(context.Background(), `SELECT count(*) FROM payments`).Scan(&n); err != nil || n != 2 {
		t.Errorf("%d payments (%v), want 2: nothing run again", n, err)
	}
}

// TestRunSealFlagsRefused: -seal-require and -seal-key-file-insecure
// without a key file, and -seal-require with an open-only first key, are
// refused, naming both.
func TestRunSealFlagsRefused(t *testing.T) {
	openOnly := keyFile(t, "k1 "+b64(1)+" open-only\n", 0o600)
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"-seal-require"}, "-seal-require without -seal-key-file"},
		{[]string{"-seal-key-file-insecure"}, "-seal-key-file-insecure without -seal-key-file"},
		{[]string{"-seal-key-file", openOnly, "-seal-require"}, "-seal-require and an open-only first key"},
	} {
		var out bytes.Buffer
		err := run(context.Background(), append([]string{"-addr", "127.0.0.1:0"}, tt.args...), func(string) string { return "" }, &out)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("run(%q) = %v, want an error with %q", tt.args, err, tt.want)
		}
	}
}
