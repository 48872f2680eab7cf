package idempotency

import (
	"net/http"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestFingerprintVersion2 checks what version 2 of the canonical form
// changes: the values of a repeated query or form field are compared in
// their order, and nothing else is.
func TestFingerprintVersion2(t *testing.T) {
	fp := func(version int, query, contentType, body string) []byte {
		t.Helper()
		got, err := Fingerprint(version, "POST", "/v1/payments", query, contentType, []byte(body))
		require.NoError(t, err)
		return got
	}
	const form = "application/x-www-form-urlencoded"
	for _, tt := range []struct {
		name   string
		a, b   [2]string // query, form body
		sameV1 bool
		sameV2 bool
	}{
		{"repeated query field, other order", [2]string{"a=1&a=2", ""}, [2]string{"a=2&a=1", ""}, true, false},
		{"repeated form field, other order", [2]string{"", "amount=100&amount=5000"}, [2]string{"", "amount=5000&amount=100"}, true, false},
		{"distinct fields, other order", [2]string{"a=1&b=2", "x=1&y=2"}, [2]string{"b=2&a=1", "y=2&x=1"}, true, true},
		{"repeated field among others", [2]string{"b=0&a=1&c=9&a=2", ""}, [2]string{"a=1&a=2&c=9&b=0", ""}, true, true},
		{"repeated field, same order, other escapes", [2]string{"a=%31&a=2", ""}, [2]string{"a=1&a=%32", ""}, true, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ct := ""
			if tt.a[1] != "" {
				ct = form
			}
			assert.Equal(t, tt.sameV1, string(fp(1, tt.a[0], ct, tt.a[1])) == string(fp(1, tt.b[0], ct, tt.b[1])), "version 1")
			assert.Equal(t, tt.sameV2, string(fp(2, tt.a[0], ct, tt.a[1])) == string(fp(2, tt.b[0], ct, tt.b[1])), "version 2")
		})
	}
	// The same request has another fingerprint in each version (the tag),
	// so a record is only ever compared in the version it was stored with.
	assert.NotEqual(t, fp(1, "", "", `{"a":1}`), fp(2, "", "", `{"a":1}`))
}

// TestMiddlewareFingerprintVersion checks Options.FingerprintVersion: with
// 2, a request whose repeated query field is in another order is another
// request (422); with the default (1) it is the same one (a replay). It
// checks too that two servers on one store, one on each version, replay
// each other's keys, each comparing in the version the key was stored
// with, and that an unknown version is refused when the middleware is
// built.
func TestMiddlewareFingerprintVersion(t *testing.T) {
	first := call{path: "/v1/payments?amount=100&amount=5000", keys: []string{"k"}, body: "{}"}
	permuted := call{path: "/v1/payments?amount=5000&amount=100", keys: []string{"k"}, body: "{}"}
	for _, tt := range []struct {
		version      int
		wantPermuted int
	}{{0, http.StatusCreated}, {1, http.StatusCreated}, {2, http.StatusUnprocessableEntity}} {
		var runs atomic.Int32
		ts := mwServer(t, NewMemoryStore(), Options{FingerprintVersion: tt.version}, func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			w.WriteHeader(http.StatusCreated)
		})
		require.Equal(t, http.StatusCreated, ts.mustSend(t, first).status)
		r := ts.mustSend(t, permuted)
		assert.Equal(t, tt.wantPermuted, r.status, "version %d: %s", tt.version, r.body)
		if r.status == http.StatusCreated {
			assert.True(t, r.replayed(), "version %d: the permuted request ran", tt.version)
		}
		again := ts.mustSend(t, first)
		assert.True(t, again.status == http.StatusCreated && again.replayed(), "version %d: the retry was not replayed: %d", tt.version, again.status)
		assert.EqualValues(t, 1, runs.Load(), "version %d: handler runs", tt.version)
	}

	t.Run("replicas on both versions", func(t *testing.T) {
		store := NewMemoryStore()
		var runs atomic.Int32
		h := func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			w.WriteHeader(http.StatusCreated)
		}
		v1 := mwServer(t, store, Options{FingerprintVersion: 1}, h)
		v2 := mwServer(t, store, Options{FingerprintVersion: 2}, h)
		for _, order := range [][2]*testServer{{v1, v2}, {v2, v1}} {
			c := first
			c.keys = []string{"k-" + order[0].URL}
			require.Equal(t, http.StatusCreated, order[0].mustSend(t, c).status)
			r := order[1].mustSend(t, c)
			assert.True(t, r.status == http.StatusCreated && r.replayed(), "a retry on the other version's server: %d %s", r.status, r.body)
		}
		assert.EqualValues(t, 2, runs.Load(), "handler runs for two keys")
		// A key stored in version 2 is compared in version 2 on a version 1
		// server too: the permuted request is another request there.
		c := first
		c.keys = []string{"k-v2-first"}
		require.Equal(t, http.StatusCreated, v2.mustSend(t, c).status)
		p := permuted
		p.keys = c.keys
		assert.Equal(t, http.StatusUnprocessableEntity, v1.mustSend(t, p).status)
	})

	for _, bad := range []int{-1, 3} {
		assert.Panics(t, func() { Middleware(NewMemoryStore(), Options{FingerprintVersion: bad}) }, "version %d", bad)
	}
}
