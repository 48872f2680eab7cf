package idempotency

import "time"

// Elapse makes every time s has stamped on its keys d earlier, as if d
// had passed: what the conformance suite asks of a backend
// (storetest.Backend.Elapse), as pgstore's tests move the rows' times.
func (s *MemoryStore) Elapse(d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, keys := range []map[keyRef]*memKey{s.keys, s.pending} {
		for _, k := range keys {
			k.rec.CreatedAt = k.rec.CreatedAt.Add(-d)
			k.rec.LockedAt = k.rec.LockedAt.Add(-d)
			if !k.expiresAt.IsZero() {
				k.expiresAt = k.expiresAt.Add(-d)
			}
		}
	}
}
