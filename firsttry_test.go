package idem

import (
	"bytes"
	"io"
	"net/http"
	"runtime"
	"testing"
	"time"
)

// allocsPerRun is testing.AllocsPerRun without its rounding down: the
// average number of allocations of f over runs calls, after one to warm
// up. The fraction matters under the race detector, where sync.Pool drops
// a quarter of what it is given back, so that a pooled buffer costs half an
// allocation per run on average (one buffer and its holder, a quarter of
// the time), and a buffer allocated per run costs one.
func allocsPerRun(runs int, f func()) float64 {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	f()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range runs {
		f()
	}
	runtime.ReadMemStats(&after)
	return float64(after.Mallocs-before.Mallocs) / float64(runs)
}

// firstTryAllocs returns the allocations of one keyed POST whose body has
// GetBody (a bytes.Reader), answered 201 with a small body of known length
// by benchBase at the first attempt and read to the end, sent through rt.
// With setKey the caller puts a new key in the header, as a user of a bare
// transport would.
func firstTryAllocs(t *testing.T, rt http.RoundTripper, setKey bool) float64 {
	t.Helper()
	return allocsPerRun(1000, func() {
		req, err := http.NewRequest(http.MethodPost, "https://api.example.com/v1/payments", bytes.NewReader(benchBody))
		if err != nil {
			t.Fatal(err)
		}
		req.Header["Content-Type"] = []string{"application/json"}
		if setKey {
			req.Header[DefaultKeyHeader] = []string{NewKey()}
		}
		resp, err := rt.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.Copy(io.Discard, resp.Body); err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	})
}

// firstTryExtraAllocs is what idem's first try allocates beyond a bare
// transport's, for a keyed POST whose body has GetBody: the attempt's
// header, a copy of the caller's with the key and the first-sent time in
// it (the map and its group), and the attempt's request with its context
// (one object), less the one-string slice in which the bare caller puts
// its key. Nothing else: the wire trace, whose two hooks tell "not sent"
// from "may have reached the server" (outcome.go), and the buffer of the
// answer read inside the attempt come in a kit that the attempt before
// gave back (attempt.go); no body copy, timer, goroutine or backoff.
const firstTryExtraAllocs = 2

// TestFirstTryAllocs checks that a keyed first try allocates exactly
// firstTryExtraAllocs more than the same POST sent by the bare base with
// the key set by its caller, with and without an AttemptTimeout: no more,
// and no fewer, so that a change that saves one also updates the count
// and its account above. The three quarters of an allocation of slack
// above are for the race detector, under which the pooled answer buffer
// costs half of one (see allocsPerRun); a buffer allocated per request
// would cost a whole one.
func TestFirstTryAllocs(t *testing.T) {
	base := roundTripFunc(benchBase)
	bare := firstTryAllocs(t, base, true)
	for _, tt := range []struct {
		name  string
		tr    *Transport
		extra float64
	}{
		{"default", &Transport{Base: base}, firstTryExtraAllocs},
		// The attempt's cancelable context, its timer, and the
		// closures that fire and stop it.
		{"AttemptTimeout", &Transport{Base: base, Retry: RetryPolicy{AttemptTimeout: time.Minute}}, firstTryExtraAllocs + 5},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got := firstTryAllocs(t, tt.tr, false) - bare
			if got < tt.extra-0.25 || got > tt.extra+0.75 {
				t.Errorf("idem allocates %.2f more than a bare transport per first try; want %v", got, tt.extra)
			}
		})
	}
}
