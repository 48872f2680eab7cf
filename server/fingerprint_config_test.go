package server

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
)

// TestConfigFingerprintVersion checks that Config.FingerprintVersion
// reaches the middleware: with 2, the same key with a repeated query field
// in another order is another request (422); with the default it is the
// same one, and replayed. Either way one payment is made.
func TestConfigFingerprintVersion(t *testing.T) {
	const body = `{"amount": 4200, "currency": "usd", "customer": "cus_1"}`
	for _, tt := range []struct {
		version int
		want    int
	}{{0, http.StatusCreated}, {2, http.StatusUnprocessableEntity}} {
		storage := NewMemoryStorage()
		ts := newTestServer(t, storage.Storage(), Config{FingerprintVersion: tt.version})
		first := call{path: "/v1/payments?tag=a&tag=b", keys: []string{"k"}, body: body}
		permuted := call{path: "/v1/payments?tag=b&tag=a", keys: []string{"k"}, body: body}
		assert.Equal(t, http.StatusCreated, ts.mustSend(t, first).status)
		r := ts.mustSend(t, permuted)
		assert.Equal(t, tt.want, r.status, "version %d: %s", tt.version, r.body)
		assert.Len(t, storage.Payments(), 1, "version %d", tt.version)
	}
}
