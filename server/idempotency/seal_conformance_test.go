package idempotency_test

import (
	"testing"

	"github.com/idemkit/idem/server/storetest"
)

// TestMemoryStoreConformanceSealed runs the conformance suite on the
// memory store with sealing on (TestMemoryStoreConformance runs it with
// sealing off); the staged writes go through the store's own unit of work
// beneath the seal's.
func TestMemoryStoreConformanceSealed(t *testing.T) {
	storetest.ExerciseSealed(t, memoryBackend)
}
