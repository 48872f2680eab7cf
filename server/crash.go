package server

import (
	"context"
	"sync"

	"github.com/idemkit/idem/server/idempotency"
)

// crashingStore wraps the key store of a server with [Config.AfterCharge]
// to simulate a crash of the process serving a request: once crash is
// called for a claim, its lease is no longer renewed and its key is not
// released, as a dead process could do neither, so the key stays started
// until a retry takes it over. The unit of work is still rolled back, as
// the database does when a crashed process's connection ends. A test seam
// of the reference server, not of the library.
type crashingStore struct {
	idempotency.Store
	crashed sync.Map // fencing token → struct{}
}

// crash marks the claim of the request in ctx as crashed.
func (s *crashingStore) crash(ctx context.Context) {
	if c, ok := idempotency.ClaimFromContext(ctx); ok {
		s.crashed.Store(c.Token, struct{}{})
	}
}

func (s *crashingStore) isCrashed(c idempotency.Claim) bool {
	_, ok := s.crashed.Load(c.Token)
	return ok
}

// Renew renews nothing for a crashed claim.
func (s *crashingStore) Renew(ctx context.Context, c idempotency.Claim) error {
	if s.isCrashed(c) {
		return nil
	}
	return s.Store.Renew(ctx, c)
}

// Release releases nothing for a crashed claim.
func (s *crashingStore) Release(ctx context.Context, c idempotency.Claim, kind idempotency.ReleaseKind) error {
	if s.isCrashed(c) {
		return nil
	}
	return s.Store.Release(ctx, c, kind)
}
