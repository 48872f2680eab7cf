package server

import "testing"

// TestEndToEndMemory runs the end-to-end tests on the in-memory store.
func TestEndToEndMemory(t *testing.T) {
	testEndToEnd(t, func(t *testing.T) Store { return NewMemoryStore() })
}
