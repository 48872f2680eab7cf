package idem

import (
	"cmp"
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestProviderKeyTooLongRefusedBeforeSending: a pinned key longer than the
// provider takes (Adyen 64, Square 45, PayPal 108, AWS 128) is refused
// before anything is sent, with ErrKeyTooLong, and the outcome is not
// sent; a key of the limit's length is sent.
func TestProviderKeyTooLongRefusedBeforeSending(t *testing.T) {
	var requests atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		w.WriteHeader(http.StatusCreated)
	}))
	defer srv.Close()
	for _, tt := range []struct {
		p   Provider
		max int
	}{{Adyen, 64}, {Square, 45}, {PayPal, 108}, {AWS, 128}, {Stripe, 255}} {
		t.Run(tt.p.Name, func(t *testing.T) {
			tr := &Transport{Base: srv.Client().Transport, Provider: tt.p, Retry: fastPolicy}
			before := requests.Load()
			if tt.max < MaxKeyLen {
				_, err := post(t, tr, WithKey(context.Background(), strings.Repeat("k", tt.max+1)), srv.URL, `{"amount":4200}`)
				require.ErrorIs(t, err, ErrKeyTooLong)
				assert.Contains(t, err.Error(), tt.p.Name)
				assert.Equal(t, OutcomeNotSent, OutcomeOf(nil, err))
				assert.Equal(t, before, requests.Load(), "nothing sent")

				// The caller's own key header, too.
				req, err := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{}`))
				require.NoError(t, err)
				req.Header.Set(cmp.Or(tt.p.KeyHeader, DefaultKeyHeader), strings.Repeat("k", tt.max+1))
				if tt.p.KeyBodyField == "" {
					_, err = tr.RoundTrip(req)
					require.ErrorIs(t, err, ErrKeyTooLong)
				}
			}
			resp, err := post(t, tr, WithKey(context.Background(), strings.Repeat("k", tt.max)), srv.URL, `{"amount":4200}`)
			require.NoError(t, err)
			resp.Body.Close()
		})
	}
}
