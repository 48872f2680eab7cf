package idempotency

import (
	"strings"
	"testing"
)

func BenchmarkFingerprint(b *testing.B) {
	benchmarkFingerprintBody(b, []byte(`{"amount": 4200, "currency": "usd", "customer": "cus_123", "metadata": {"order": "o_1", "note": "x"}}`))
}

// nestedBody returns a JSON document of depth nested objects, each
// {"b":<the next level>,"a":1}, or {"a":1,"b":<the next level>} if sorted,
// around a string that pads the document to size bytes (when the levels
// alone are shorter). The canonical form of either shape is the sorted one.
func nestedBody(depth, size int, sorted bool) []byte {
	open, close := `{"b":`, `,"a":1}`
	if sorted {
		open, close = `{"a":1,"b":`, `}`
	}
	pad := max(size-depth*(len(open)+len(close))-2, 0)
	body := make([]byte, 0, depth*(len(open)+len(close))+pad+2)
	for range depth {
		body = append(body, open...)
	}
	body = append(body, '"')
	body = append(body, strings.Repeat("x", pad)...)
	body = append(body, '"')
	for range depth {
		body = append(body, close...)
	}
	return body
}

// benchmarkFingerprintBody fingerprints body as a JSON request.
func benchmarkFingerprintBody(b *testing.B, body []byte) {
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if _, err := Fingerprint("POST", "/v1/payments", "", "application/json", body); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkFingerprintNestedUnsorted fingerprints a 1 MiB body of 999
// nested objects whose members are out of order at every level
// ({"b":{"b":…,"a":1},"a":1}): the shape that once cost O(depth × size).
func BenchmarkFingerprintNestedUnsorted(b *testing.B) {
	benchmarkFingerprintBody(b, nestedBody(999, 1<<20, false))
}

// BenchmarkFingerprintNestedSorted fingerprints the same document with its
// members already in order at every level ({"a":1,"b":{"a":1,"b":…}}).
func BenchmarkFingerprintNestedSorted(b *testing.B) {
	benchmarkFingerprintBody(b, nestedBody(999, 1<<20, true))
}
