package pgstore

// QueuedClaims returns how many claims of s wait for the next batch (see
// Store.BatchClaims).
func QueuedClaims(s *Store) int {
	s.claims.mu.Lock()
	defer s.claims.mu.Unlock()
	return len(s.claims.queue)
}
