package idem

import (
	"math"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestMaxBufferedBodyLargest checks that the largest MaxBufferedBody,
// math.MaxInt64, buffers a body without GetBody, of unknown or known
// length, with or without KeyBodyField, and sends it again on a retry:
// limit+1 must not overflow into a negative capacity or read limit.
func TestMaxBufferedBodyLargest(t *testing.T) {
	const body = `{"amount":4200,"currency":"usd"}`
	for _, field := range []string{"", testField} {
		for _, length := range []int64{-1, 0, int64(len(body))} { // unknown, unknown, known
			base := &sentBody{}
			failing := roundTripFunc(func(req *http.Request) (*http.Response, error) {
				if len(base.bodies) == 0 {
					resp, _ := base.RoundTrip(req)
					resp.StatusCode, resp.Status = http.StatusServiceUnavailable, "503 Service Unavailable"
					return resp, nil
				}
				return base.RoundTrip(req)
			})
			tr := &Transport{Base: failing, KeyBodyField: field, MaxBufferedBody: math.MaxInt64, Retry: fastPolicy}
			req, err := http.NewRequest(http.MethodPost, mockURL, bodyOnly{strings.NewReader(body)})
			require.NoError(t, err)
			req.ContentLength = length
			resp, err := tr.RoundTrip(req)
			require.NoError(t, err, "field %q, ContentLength %d", field, length)
			resp.Body.Close()
			assert.Equal(t, http.StatusCreated, resp.StatusCode)
			require.Len(t, base.bodies, 2, "field %q, ContentLength %d", field, length)
			assert.Equal(t, base.bodies[0], base.bodies[1], "the retry sends the same bytes")
			assert.Contains(t, base.bodies[0], `"amount":4200`)
		}
	}
}
