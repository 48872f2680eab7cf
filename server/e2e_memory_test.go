package server

import "testing"

// TestEndToEndMemory runs the end-to-end tests on the in-memory storage.
func TestEndToEndMemory(t *testing.T) {
	testEndToEnd(t, memoryStorage)
}
