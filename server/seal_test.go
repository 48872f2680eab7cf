package server

import (
	"bytes"
	"context"
	"encoding/base64"
	"net/http"
	"strings"
	"testing"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/storetest"
)

// sealed returns newStorage with its key store sealed.
func sealed(newStorage newStorageFunc) newStorageFunc {
	return func(t *testing.T) Storage {
		s := newStorage(t)
		s.Keys = idempotency.Sealed(s.Keys, storetest.SealKeys(t, "k1"))
		return s
	}
}

// TestEndToEndSealed runs the end-to-end tests of answers and replays with
// the stored responses sealed, in memory and on PostgreSQL: sealing
// changes nothing a client sees.
func TestEndToEndSealed(t *testing.T) {
	t.Run("memory", func(t *testing.T) { testEndToEndResponses(t, sealed(memoryStorage)) })
	t.Run("postgres", func(t *testing.T) { testEndToEndResponses(t, sealed(postgresStorage)) })
}

// TestConfigSealKeys: with Config.SealKeys, a payment's stored response is
// sealed in the key table (its status in the clear), its replay is the
// first answer byte for byte, the payment itself is in the payments table
// as always, and a server whose keys do not include the sealing one
// answers the replay 500 without charging again.
func TestConfigSealKeys(t *testing.T) {
	pool := migratedPool(t)
	ts := newTestServer(t, NewPostgresStorage(pool).Storage(), Config{SealKeys: storetest.SealKeys(t, "k1")})
	first := ts.mustSend(t, keyed("k-sealed", payment))
	p := first.created(t, "k-sealed")
	again := ts.mustSend(t, keyed("k-sealed", payment))
	if !again.replayed() || !bytes.Equal(again.body, first.body) {
		t.Errorf("replay %d %q, want %q", again.status, again.body, first.body)
	}
	for _, h := range []string{"Content-Type", "Location", "Content-Length"} {
		if again.header.Get(h) != first.header.Get(h) {
			t.Errorf("replayed %s = %q, want %q", h, again.header.Get(h), first.header.Get(h))
		}
	}
	var status int
	var ct string
	var body []byte
	if err := pool.QueryRow(context.Background(), `
		SELECT response_status, response_content_type, response_body FROM idempotency_keys WHERE idempotency_key = 'k-sealed'`).
		Scan(&status, &ct, &body); err != nil {
		t.Fatal(err)
	}
	if status != http.StatusCreated || ct != idempotency.SealedMediaType+"; key=k1" || bytes.Contains(body, []byte(p.ID)) || bytes.Contains(body, []byte("cus_123")) {
		t.Errorf("stored %d %q %q: want 201 and the rest sealed with k1", status, ct, body)
	}
	if got := ts.mustSend(t, call{method: "GET", path: "/v1/payments/" + p.ID}); got.status != http.StatusOK {
		t.Errorf("GET the payment: %d", got.status)
	}

	other := newTestServer(t, NewPostgresStorage(pool).Storage(), Config{SealKeys: storetest.SealKeys(t, "k2")})
	r := other.mustSend(t, keyed("k-sealed", payment))
	if r.status != http.StatusInternalServerError || r.problem(t).Type != idempotency.ProblemResponseSealed {
		t.Errorf("replay on a server without k1: %d %q, want 500 %s", r.status, r.body, idempotency.ProblemResponseSealed)
	}
	if n := ts.charges.created.Load() + other.charges.created.Load(); n != 1 {
		t.Errorf("%d charges, want 1", n)
	}
	if n := ts.payments(t); n != 1 {
		t.Errorf("%d payments, want 1", n)
	}
}

// sealKeyFile is a well-formed key file: comments, a blank line, two keys.
var sealKeyFile = "# id  key\n\n2026-02 " + b64(32, 1) + "\n\t2026-01\t" + b64(32, 2) + "  \n"

// b64 returns n bytes of value v in standard base64.
func b64(n int, v byte) string { return base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{v}, n)) }

func TestParseSealKeys(t *testing.T) {
	keys, err := ParseSealKeys(strings.NewReader(sealKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	if len(keys) != 2 || keys[0].ID != "2026-02" || keys[1].ID != "2026-01" || !bytes.Equal(keys[1].Secret, bytes.Repeat([]byte{2}, 32)) || keys[0].OpenOnly {
		t.Errorf("keys %+v", keys)
	}
	keys, err = ParseSealKeys(strings.NewReader("a " + b64(32, 1) + " open-only\nb " + b64(32, 2)))
	if err != nil || len(keys) != 2 || !keys[0].OpenOnly || keys[1].OpenOnly {
		t.Errorf("open-only first: %+v, %v", keys, err)
	}
	if keys, err := ParseSealKeys(strings.NewReader("\ufeff2026-02 " + b64(32, 1) + "\r\n2026-01 " + b64(32, 2) + "\r\n")); err != nil || len(keys) != 2 || keys[0].ID != "2026-02" {
		t.Errorf("a file with a byte order mark and CRLF lines: %+v, %v", keys, err)
	}
	// The examples of the doc comment parse.
	if _, err := ParseSealKeys(strings.NewReader("2026-02    q83vEjRWeJq83vEjRWeJq83vEjRWeJq83vEjRWeJq80=\n2026-01    3q2+796tvu/erb7v3q2+796tvu/erb7v3q2+796tvu8=\n")); err != nil {
		t.Errorf("the documented example: %v", err)
	}
	secret := b64(32, 7)
	for _, tt := range []struct {
		name, file, want string
	}{
		{"empty", "", "no key"},
		{"comments only", "# nothing\n\n", "no key"},
		{"id alone", "k1\n", "line 1: want"},
		{"three fields", "k1 " + secret + " extra", "line 1: want"},
		{"bad base64", "# c\nk1 not-base64!", "line 2, column 2: the key is not 32 bytes"},
		{"short key", "k1 " + b64(16, 1), "not 32 bytes"},
		{"long key", "k1 " + b64(33, 1), "not 32 bytes"},
		{"url base64", "k1 " + strings.ReplaceAll(b64(32, 0xfb), "+", "-"), "not 32 bytes"},
		{"bad id", "k/1 " + secret, "line 1, column 1: the id is not"},
		{"duplicate id", "k1 " + secret + "\nk1 " + b64(32, 8), "line 2, column 1: the id is the one on line 1"},
		{"open-only below the first", "k1 " + secret + "\nk2 " + b64(32, 8) + " open-only", "line 2, column 3: open-only is for the first key"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			keys, err := ParseSealKeys(strings.NewReader(tt.file))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("ParseSealKeys = %+v, %v; want an error with %q", keys, err, tt.want)
			}
			if strings.Contains(err.Error(), secret) {
				t.Errorf("the error shows the secret: %v", err)
			}
		})
	}
}

// TestParseSealKeysNamesNoSecret: a file with a secret where the id
// belongs (the columns swapped, the key pasted twice, a key in another
// encoding) is refused with an error that names the line and the column
// and shows no part of any secret on the line.
func TestParseSealKeysNamesNoSecret(t *testing.T) {
	std := b64(32, 0xfb) // holds + and /
	url := base64.RawURLEncoding.EncodeToString(bytes.Repeat([]byte{0xfb}, 32))
	hexKey := strings.Repeat("fb", 32)
	for _, tt := range []struct {
		name, file, want string
		secrets          []string
	}{
		{"columns swapped", "# keys\n" + std + " 2026-01\n", "line 2, column 2", []string{std}},
		{"columns swapped, second line", "2026-02 " + b64(32, 1) + "\n" + std + " 2026-01\n", "line 2, column 2", []string{std, b64(32, 1)}},
		{"key pasted twice", std + " " + std + "\n", "line 1, column 1", []string{std}},
		{"url-safe key as the id", url + " " + std + "\n", "line 1, column 1", []string{url, std}},
		{"hex key as the id", hexKey + " " + std + "\n", "line 1, column 1", []string{hexKey, std}},
		{"key twice, open-only", std + " " + std + " open-only\n", "line 1, column 1", []string{std}},
		{"key and garbage", std + " x y z\n", "line 1: want two columns", []string{std}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			keys, err := ParseSealKeys(strings.NewReader(tt.file))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("ParseSealKeys = %+v, %v; want an error with %q", keys, err, tt.want)
			}
			for _, s := range tt.secrets {
				// Any 8 characters of it would be too many.
				for i := 0; i+8 <= len(s); i++ {
					if strings.Contains(err.Error(), s[i:i+8]) {
						t.Fatalf("the error shows part of a secret (%q): %v", s[i:i+8], err)
					}
				}
			}
		})
	}
}
