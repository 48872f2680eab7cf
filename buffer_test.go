package idem

import (
	"context"
	"math"
	"net/http"
	"runtime"
	"strings"
	"testing"
	"time"

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

// TestNilResponseBody checks that a Base answering with a nil Body, which
// http.Client accepts as an empty one, is taken the same way: the
// Transport drains and reads problem details from it without panicking
// (a panic in the drain's timer goroutine could not even be recovered).
// A nil Body with a ContentLength is refused, as http.Client refuses it.
func TestNilResponseBody(t *testing.T) {
	noBody := func(code int, contentLength int64) *http.Response {
		return &http.Response{StatusCode: code, Status: http.StatusText(code), Header: http.Header{}, ContentLength: contentLength}
	}
	for _, tt := range []struct {
		name   string
		script []*http.Response
		check  func(t *testing.T, resp *http.Response, err error)
	}{
		{"503 then 201", []*http.Response{noBody(503, 0), noBody(201, 0)}, func(t *testing.T, resp *http.Response, err error) {
			require.NoError(t, err)
			assert.Equal(t, 201, resp.StatusCode)
			assert.Equal(t, http.NoBody, resp.Body)
		}},
		{"unknown length", []*http.Response{noBody(503, -1), noBody(201, -1)}, func(t *testing.T, resp *http.Response, err error) {
			require.NoError(t, err)
			assert.Equal(t, http.NoBody, resp.Body)
		}},
		{"409 then 201", []*http.Response{noBody(409, 0), noBody(201, 0)}, func(t *testing.T, resp *http.Response, err error) {
			require.NoError(t, err)
			assert.Equal(t, 201, resp.StatusCode)
		}},
		{"422", []*http.Response{noBody(422, 0)}, func(t *testing.T, _ *http.Response, err error) {
			var reuse *KeyReuseError
			require.ErrorAs(t, err, &reuse)
			assert.NotNil(t, reuse.Problem)
		}},
		{"ContentLength without a Body", []*http.Response{noBody(201, 5)}, func(t *testing.T, _ *http.Response, err error) {
			require.Error(t, err)
			assert.Contains(t, err.Error(), "nil Body")
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var n int
			base := roundTripFunc(func(req *http.Request) (*http.Response, error) {
				req.Body.Close()
				resp := tt.script[min(n, len(tt.script)-1)]
				n++
				copied := *resp
				copied.Request = req
				return &copied, nil
			})
			// AttemptTimeout arms the drain's timer too.
			p := fastPolicy
			p.AttemptTimeout = time.Minute
			tr := &Transport{Base: base, Retry: p}
			resp, err := post(t, tr, context.Background(), mockURL, `{"amount":4200}`)
			tt.check(t, resp, err)
			if resp != nil {
				resp.Body.Close()
			}
		})
	}
}

// TestLyingContentLengthAllocatesLittle checks that a request whose
// ContentLength claims far more than its body holds is not given a buffer
// of that size up front: it is refused, as net/http refuses it, having
// allocated about what the body holds.
func TestLyingContentLengthAllocatesLittle(t *testing.T) {
	const claimed = 1 << 30
	for _, field := range []string{"", testField} {
		tr := &Transport{Base: &sentBody{}, KeyBodyField: field, MaxBufferedBody: 2 * claimed}
		req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, mockURL, bodyOnly{strings.NewReader(`{"amount":4200}`)})
		require.NoError(t, err)
		req.ContentLength = claimed
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		_, err = tr.RoundTrip(req)
		runtime.ReadMemStats(&after)
		require.Error(t, err, "field %q", field)
		assert.Contains(t, err.Error(), "ContentLength=1073741824 with Body length 15")
		assert.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(16<<20), "field %q: bytes allocated for a 15-byte body", field)
	}
}
