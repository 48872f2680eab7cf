package idem

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if any goroutine outlives them: the
// Transport must start none that outlive RoundTrip.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
