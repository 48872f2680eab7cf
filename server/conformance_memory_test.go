package server_test

import (
	"testing"

	"github.com/idemkit/idem/server"
	"github.com/idemkit/idem/server/storetest"
)

func TestMemoryStoreConformance(t *testing.T) {
	storetest.Exercise(t, func(t *testing.T) storetest.Backend {
		s := server.NewMemoryStore()
		return storetest.Backend{Store: s, Payments: s, Charges: s}
	})
}
