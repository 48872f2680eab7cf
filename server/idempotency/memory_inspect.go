package idempotency

import (
	"cmp"
	"context"
	"slices"
	"time"
)

// The MemoryStore is an [Inspector] and [Sweepable], as the PostgreSQL
// store is.
var (
	_ Inspector = (*MemoryStore)(nil)
	_ Sweepable = (*MemoryStore)(nil)
)

// info returns k as an operator sees it at now; the response's body only
// with body.
func (k *memKey) info(now time.Time, body bool) KeyInfo {
	rec := k.rec.clone()
	info := KeyInfo{
		ClientID:    rec.ClientID,
		Key:         rec.Key,
		Method:      rec.Method,
		Path:        rec.Path,
		Status:      rec.Status,
		ReleaseKind: k.release,
		OperationID: k.operationID,
		Token:       k.token,
		CreatedAt:   rec.CreatedAt,
		LockedAt:    rec.LockedAt,
		ExpiresAt:   k.expiresAt,
		Lease:       k.lease,
		Retention:   k.retention,
		LeaseAge:    now.Sub(rec.LockedAt),
		Lapsed:      k.stale(now),
		Expired:     k.expired(now),
		Response:    rec.Response,
	}
	if rec.Status != StatusReleased {
		info.ReleaseKind = ReleaseFailed
	}
	if rec.Status != StatusStarted && k.retention > 0 && !k.expiresAt.IsZero() {
		info.FinishedAt = k.expiresAt.Add(-k.retention)
	}
	if info.Response != nil && !body {
		info.Response.Body = nil
	}
	return info
}

// releasedAt is when k was released, or the last lease renewal before it
// when that is not kept (no retention), as the PostgreSQL store tells.
func (k *memKey) releasedAt() time.Time {
	if k.retention > 0 && !k.expiresAt.IsZero() {
		return k.expiresAt.Add(-k.retention)
	}
	return k.rec.LockedAt
}

// abandoned reports whether k is abandoned at now with grace (see
// [Sweepable]).
func (k *memKey) abandoned(now time.Time, grace time.Duration) bool {
	switch {
	case k.expired(now):
		return false
	case k.rec.Status == StatusStarted:
		return k.stale(now) && now.Sub(k.rec.LockedAt) >= k.lease+grace
	case k.rec.Status == StatusReleased:
		return k.release == ReleaseFailed && now.Sub(k.releasedAt()) >= grace
	}
	return false
}

// live returns the key of clientID that does not count as absent, or nil.
func (s *MemoryStore) live(clientID, key string, now time.Time) *memKey {
	k := s.keys[keyRef{clientID, key}]
	if k == nil || k.expired(now) {
		return nil
	}
	return k
}

// Lookup implements [Inspector.Lookup].
func (s *MemoryStore) Lookup(ctx context.Context, clientID, key string, body bool) (KeyInfo, error) {
	if err := ctx.Err(); err != nil {
		return KeyInfo{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	k := s.keys[keyRef{clientID, key}]
	if k == nil {
		return KeyInfo{}, ErrKeyNotFound
	}
	return k.info(s.now(), body), nil
}

// List implements [Inspector.List].
func (s *MemoryStore) List(ctx context.Context, f ListFilter) ([]KeyInfo, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if f.Status != StatusStarted && f.Status != StatusReleased {
		return nil, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	return s.collect(now, f.EffectiveLimit(), func(k *memKey) bool {
		switch {
		case k.rec.Status != f.Status || k.expired(now) || (f.ClientID != "" && k.rec.ClientID != f.ClientID):
			return false
		case f.Status == StatusStarted:
			return now.Sub(k.rec.CreatedAt) >= f.OlderThan
		}
		return now.Sub(k.releasedAt()) >= f.OlderThan
	}, func(a, b KeyInfo) int { return a.CreatedAt.Compare(b.CreatedAt) }), nil
}

// collect returns the infos of at most limit keys that keep selects, in
// the order of by, then by client and key. The caller holds s.mu.
func (s *MemoryStore) collect(now time.Time, limit int, keep func(*memKey) bool, by func(a, b KeyInfo) int) []KeyInfo {
	var out []KeyInfo
	for _, k := range s.keys {
		if keep(k) {
			out = append(out, k.info(now, false))
		}
	}
	slices.SortFunc(out, func(a, b KeyInfo) int {
		return cmp.Or(by(a, b), cmp.Compare(a.ClientID, b.ClientID), cmp.Compare(a.Key, b.Key))
	})
	return out[:min(len(out), max(limit, 0))]
}

// ForceRelease implements [Inspector.ForceRelease].
func (s *MemoryStore) ForceRelease(ctx context.Context, clientID, key string, running bool) (KeyInfo, error) {
	return s.act(ctx, clientID, key, running, func(k *memKey, now time.Time) error {
		switch k.rec.Status {
		case StatusCompleted:
			return ErrKeyCompleted
		case StatusStarted:
			s.fence(k)
			k.rec.Status = StatusReleased
			k.release = ReleaseFailed
			k.finish(now)
		}
		return nil
	})
}

// Expire implements [Inspector.Expire]: the key expires a nanosecond ago
// by the store's clock, and keeps its creation time and retention, which
// tell the purge when it may delete it (see memKey.purgeable).
func (s *MemoryStore) Expire(ctx context.Context, clientID, key string, running bool) (KeyInfo, error) {
	return s.act(ctx, clientID, key, running, func(k *memKey, now time.Time) error {
		s.fence(k)
		if k.rec.Status == StatusStarted {
			k.rec.Status = StatusReleased
			k.release = ReleaseRejected
		}
		k.expiresAt = now.Add(-time.Nanosecond)
		return nil
	})
}

// act runs change on the live key of clientID, unless it is running and
// running is false, and returns the key as it was.
func (s *MemoryStore) act(ctx context.Context, clientID, key string, running bool, change func(*memKey, time.Time) error) (KeyInfo, error) {
	if err := ctx.Err(); err != nil {
		return KeyInfo{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	k := s.live(clientID, key, now)
	if k == nil {
		return KeyInfo{}, ErrKeyNotFound
	}
	was := k.info(now, false)
	if was.Running() && !running {
		return was, ErrKeyRunning
	}
	return was, change(k, now)
}

// fence gives k a new token, which no claim holds: its owner, if any, is
// fenced. The caller holds s.mu.
func (s *MemoryStore) fence(k *memKey) {
	s.lastToken++
	k.token = s.lastToken
}

// Stats implements [Inspector.Stats].
func (s *MemoryStore) Stats(ctx context.Context) (KeyStats, error) {
	if err := ctx.Err(); err != nil {
		return KeyStats{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	var st KeyStats
	for _, k := range s.keys {
		switch {
		case k.expired(now):
		case k.rec.Status == StatusStarted && k.stale(now):
			st.Lapsed++
		case k.rec.Status == StatusStarted:
			st.Running++
			st.OldestRunning = max(st.OldestRunning, now.Sub(k.rec.CreatedAt))
		case k.rec.Status == StatusReleased && k.release == ReleaseFailed:
			st.ReleasedFailed++
		}
	}
	return st, nil
}

// Abandoned implements [Sweepable.Abandoned].
func (s *MemoryStore) Abandoned(ctx context.Context, grace time.Duration, limit int) ([]KeyInfo, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	return s.collect(now, limit, func(k *memKey) bool { return k.abandoned(now, grace) },
		func(a, b KeyInfo) int { return a.LockedAt.Compare(b.LockedAt) }), nil
}

// Adopt implements [Sweepable.Adopt].
func (s *MemoryStore) Adopt(ctx context.Context, info KeyInfo, grace, lease time.Duration) (Claim, error) {
	if err := ctx.Err(); err != nil {
		return Claim{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	k := s.keys[keyRef{info.ClientID, info.Key}]
	if k == nil || k.token != info.Token || k.rec.Status != info.Status || !k.abandoned(now, grace) {
		return Claim{}, ErrFenced
	}
	s.fence(k)
	k.rec.Status = StatusStarted
	k.lease = max(lease, 0)
	k.lock(now)
	return k.claim(), nil
}
