package idem

import (
	"math"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/stretchr/testify/assert"
)

// TestNextBackoffOverflow checks that a jittered wait of centuries, which
// overflows time.Duration inside the backoff library, waits MaxInterval
// rather than a negative time (no wait at all).
func TestNextBackoffOverflow(t *testing.T) {
	const century = 100 * 365 * 24 * time.Hour
	p := &RetryPolicy{InitialInterval: 2 * century, Jitter: 0.9, Multiplier: 1.5, MaxInterval: math.MaxInt64}
	var b *backoff.ExponentialBackOff
	for i := range 200 {
		d := next(&b, p)
		assert.Positive(t, d, "wait %d", i)
		if d <= 0 {
			break
		}
	}
}
