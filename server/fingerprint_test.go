package server

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
)

// TestRepeatedQueryFieldOrder checks that the server compares a repeated
// query field's values in their order: the same key with them in another
// order is another request (422), and one payment is made.
func TestRepeatedQueryFieldOrder(t *testing.T) {
	const body = `{"amount": 4200, "currency": "usd", "customer": "cus_1"}`
	storage := NewMemoryStorage()
	ts := newTestServer(t, storage.Storage(), Config{})
	first := call{path: "/v1/payments?tag=a&tag=b", keys: []string{"k"}, body: body}
	permuted := call{path: "/v1/payments?tag=b&tag=a", keys: []string{"k"}, body: body}
	assert.Equal(t, http.StatusCreated, ts.mustSend(t, first).status)
	r := ts.mustSend(t, permuted)
	assert.Equal(t, http.StatusUnprocessableEntity, r.status, "%s", r.body)
	again := ts.mustSend(t, first)
	assert.True(t, again.status == http.StatusCreated && again.replayed(), "the retry: %d, replayed %v", again.status, again.replayed())
	assert.Len(t, storage.Payments(), 1)
}
