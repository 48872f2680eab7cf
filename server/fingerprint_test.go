package server

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"
)

const (
	ctJSON = "application/json"
	ctForm = "application/x-www-form-urlencoded"
)

// canonicalTests lists bodies and their version 1 canonical form; wantErr
// marks bodies the canonicaliser rejects.
var canonicalTests = []struct {
	name        string
	contentType string
	body        string
	want        string
	wantErr     bool
}{
	{"payment", ctJSON, `{"amount": 4200, "currency": "usd", "customer": "cus_123"}`, `{"amount":4200,"currency":"usd","customer":"cus_123"}`, false},
	{"reordered", ctJSON, "{\n  \"customer\": \"cus_123\",\n  \"currency\": \"usd\",\n  \"amount\": 4200\n}", `{"amount":4200,"currency":"usd","customer":"cus_123"}`, false},
	{"nested", ctJSON, `{"b":[3,{"z":1,"y":null}],"a":{"d":true,"c":false}}`, `{"a":{"c":false,"d":true},"b":[3,{"y":null,"z":1}]}`, false},
	{"numbers exact", ctJSON, `[1.0, 1, 1e0, -0, 12345678901234567890123]`, `[1.0,1,1e0,-0,12345678901234567890123]`, false},
	{"strings re-escaped", ctJSON, `["\u0041<>&", "\/", "é\u00e9"]`, `["A<>&","/","éé"]`, false},
	{"charset param", "application/json; charset=utf-8", `{ }`, `{}`, false},
	{"+json", "application/merge-patch+json", `{"a" : 1}`, `{"a":1}`, false},
	{"no content type", "", `{"a" : 1}`, `{"a":1}`, false},
	{"scalar", ctJSON, ` "x" `, `"x"`, false},
	{"empty body", ctJSON, ``, ``, false},
	{"duplicate key", ctJSON, `{"a":1,"a":2}`, ``, true},
	{"nested duplicate", ctJSON, `{"x":{"a":1,"a":1}}`, ``, true},
	{"trailing data", ctJSON, `{} {}`, ``, true},
	{"truncated", ctJSON, `{"a":`, ``, true},
	{"invalid utf-8", ctJSON, "\"\xff\"", ``, true},
	{"not json", ctJSON, `amount=1`, ``, true},
	{"too deep", ctJSON, strings.Repeat("[", 1002) + strings.Repeat("]", 1002), ``, true},
	{"form", ctForm, `customer=cus_123&currency=usd&amount=4200`, `amount=4200&currency=usd&customer=cus_123`, false},
	{"form values sorted", ctForm, `a=2&b=1&a=1`, `a=1&a=2&b=1`, false},
	{"form escapes", ctForm, `name=J%C3%B6rg+M&x=a%2Bb`, `name=J%C3%B6rg+M&x=a%2Bb`, false},
	{"form bad escape", ctForm, `a=%zz`, ``, true},
	{"raw", "text/plain", `{"b":1, "a":2}`, `{"b":1, "a":2}`, false},
}

func TestCanonicalBody(t *testing.T) {
	for _, tt := range canonicalTests {
		t.Run(tt.name, func(t *testing.T) {
			_, got, err := CanonicalBody(tt.contentType, []byte(tt.body))
			if tt.wantErr {
				if !errors.Is(err, ErrBody) {
					t.Fatalf("CanonicalBody(%q) error = %v, want ErrBody", tt.body, err)
				}
				return
			}
			if err != nil || string(got) != tt.want {
				t.Errorf("CanonicalBody(%q) = %s, %v; want %s", tt.body, got, err, tt.want)
			}
		})
	}
}

func mustFingerprint(t *testing.T, method, path, query, contentType, body string) []byte {
	t.Helper()
	fp, err := Fingerprint(FingerprintVersion, method, path, query, contentType, []byte(body))
	if err != nil {
		t.Fatalf("Fingerprint(%s %s %q): %v", method, path, body, err)
	}
	return fp
}

func TestFingerprint(t *testing.T) {
	const payment = `{"amount": 4200, "currency": "usd", "customer": "cus_123"}`
	base := mustFingerprint(t, "POST", "/v1/payments", "", ctJSON, payment)
	if len(base) != 32 {
		t.Fatalf("fingerprint is %d bytes, want a SHA-256", len(base))
	}
	same := []struct{ name, method, path, query, ct, body string }{
		{"reordered and spaced", "POST", "/v1/payments", "", ctJSON, "{\"customer\":\"cus_123\",\n\"amount\":4200,\"currency\":\"usd\"}"},
		{"charset", "POST", "/v1/payments", "", "application/json; charset=utf-8", payment},
		{"no content type", "POST", "/v1/payments", "", "", payment},
	}
	for _, tt := range same {
		if got := mustFingerprint(t, tt.method, tt.path, tt.query, tt.ct, tt.body); !bytes.Equal(got, base) {
			t.Errorf("%s: fingerprint differs from the original", tt.name)
		}
	}
	different := []struct{ name, method, path, query, ct, body string }{
		{"amount", "POST", "/v1/payments", "", ctJSON, `{"amount": 4201, "currency": "usd", "customer": "cus_123"}`},
		{"amount as float", "POST", "/v1/payments", "", ctJSON, `{"amount": 4200.0, "currency": "usd", "customer": "cus_123"}`},
		{"amount as string", "POST", "/v1/payments", "", ctJSON, `{"amount": "4200", "currency": "usd", "customer": "cus_123"}`},
		{"method", "PATCH", "/v1/payments", "", ctJSON, payment},
		{"path", "POST", "/v1/refunds", "", ctJSON, payment},
		{"query", "POST", "/v1/payments", "expand=charge", ctJSON, payment},
		{"form encoding", "POST", "/v1/payments", "", ctForm, "amount=4200&currency=usd&customer=cus_123"},
		{"raw", "POST", "/v1/payments", "", "text/plain", payment},
		{"empty", "POST", "/v1/payments", "", ctJSON, ""},
	}
	seen := map[string]string{string(base): "original"}
	for _, tt := range different {
		got := string(mustFingerprint(t, tt.method, tt.path, tt.query, tt.ct, tt.body))
		if prev, ok := seen[got]; ok {
			t.Errorf("%s: fingerprint equals that of %s", tt.name, prev)
		}
		seen[got] = tt.name
	}
	// Form bodies of one payment fingerprint alike, whatever the field order;
	// so do queries.
	form := mustFingerprint(t, "POST", "/v1/payments", "", ctForm, "amount=4200&currency=usd&customer=cus_123")
	for _, body := range []string{"customer=cus_123&amount=4200&currency=usd", "currency=usd&customer=cus_123&amount=4200"} {
		if got := mustFingerprint(t, "POST", "/v1/payments", "", ctForm+"; charset=utf-8", body); !bytes.Equal(got, form) {
			t.Errorf("form %q fingerprints differently", body)
		}
	}
	q := mustFingerprint(t, "POST", "/v1/payments", "a=1&b=2", ctJSON, payment)
	if got := mustFingerprint(t, "POST", "/v1/payments", "b=2&a=1", ctJSON, payment); !bytes.Equal(got, q) {
		t.Error("reordered query fingerprints differently")
	}
	if _, err := Fingerprint(2, "POST", "/", "", ctJSON, nil); !errors.Is(err, ErrFingerprintVersion) {
		t.Errorf("version 2: %v, want ErrFingerprintVersion", err)
	}
}

// decodeJSON decodes a document as the fuzz oracle sees it.
func decodeJSON(s string) (any, bool) {
	dec := json.NewDecoder(strings.NewReader(s))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil || dec.More() {
		return nil, false
	}
	return v, true
}

// reencode writes v with object members in reverse key order and spaces
// around every token: a document equal to v, written another way.
func reencode(b *strings.Builder, v any) {
	b.WriteString(" \n")
	switch v := v.(type) {
	case map[string]any:
		keys := make([]string, 0, len(v))
		for k := range v {
			keys = append(keys, k)
		}
		// Reverse of sorted order.
		for i := range keys {
			for j := i + 1; j < len(keys); j++ {
				if keys[j] > keys[i] {
					keys[i], keys[j] = keys[j], keys[i]
				}
			}
		}
		b.WriteString("{")
		for i, k := range keys {
			if i > 0 {
				b.WriteString(" ,\t")
			}
			kb, _ := json.Marshal(k)
			b.Write(kb)
			b.WriteString(" : ")
			reencode(b, v[k])
		}
		b.WriteString("}")
	case []any:
		b.WriteString("[")
		for i, e := range v {
			if i > 0 {
				b.WriteString(" , ")
			}
			reencode(b, e)
		}
		b.WriteString("]")
	case json.Number:
		b.WriteString(string(v))
	default:
		vb, _ := json.Marshal(v)
		b.Write(vb)
	}
	b.WriteString("\r\n")
}

// FuzzFingerprint checks that two JSON documents fingerprint alike exactly
// when they are equal (as decoded with exact numbers), and that a document
// rewritten with reordered keys and other whitespace fingerprints alike.
// The seed corpus is the unit-test table plus testdata/fuzz/FuzzFingerprint.
func FuzzFingerprint(f *testing.F) {
	for _, tt := range canonicalTests {
		if tt.contentType == ctJSON {
			f.Add(tt.body, `{"amount":4200,"currency":"usd","customer":"cus_123"}`)
		}
	}
	f.Fuzz(func(t *testing.T, a, b string) {
		fa, errA := Fingerprint(FingerprintVersion, "POST", "/p", "", ctJSON, []byte(a))
		fb, errB := Fingerprint(FingerprintVersion, "POST", "/p", "", ctJSON, []byte(b))
		va, okA := decodeJSON(a)
		vb, _ := decodeJSON(b)
		if errA == nil && a != "" && !okA {
			t.Fatalf("accepted a document encoding/json rejects: %q", a)
		}
		if errA == nil && errB == nil && a != "" && b != "" {
			if equal := reflect.DeepEqual(va, vb); equal != bytes.Equal(fa, fb) {
				t.Fatalf("documents equal=%v but fingerprints equal=%v:\n%q\n%q", equal, !equal, a, b)
			}
		}
		if errA != nil || a == "" {
			return
		}
		var re strings.Builder
		reencode(&re, va)
		fr, err := Fingerprint(FingerprintVersion, "POST", "/p", "", ctJSON, []byte(re.String()))
		if err != nil {
			t.Fatalf("rewritten document %q rejected: %v", re.String(), err)
		}
		if !bytes.Equal(fa, fr) {
			t.Fatalf("rewritten document fingerprints differently:\n%q\n%q", a, re.String())
		}
	})
}

// TestWriteString checks the string escaping against encoding/json's.
func TestWriteString(t *testing.T) {
	var all strings.Builder
	for c := range 0x80 {
		all.WriteByte(byte(c))
	}
	for _, s := range []string{"", "plain", all.String(), "<>&", "é😀\u2028\u2029\ufffd", `"\\"`} {
		var got bytes.Buffer
		writeString(&got, s)
		var want bytes.Buffer
		enc := json.NewEncoder(&want)
		enc.SetEscapeHTML(false)
		enc.Encode(s)
		if got.String()+"\n" != want.String() {
			t.Errorf("writeString(%q) = %s, want %s", s, got.String(), want.String())
		}
	}
}
