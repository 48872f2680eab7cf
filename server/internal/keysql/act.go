package keysql

import (
	"errors"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

// An Action is an inspector's change of one key, which a store runs in one
// transaction: ActSQL locks and reads the key's row, [Action.Plan] says
// what to run on it, and [Outcome] what to answer.
type Action int

const (
	// ForceRelease releases a started key as failed under a new token
	// (ForceReleaseSQL); a released one is left as it is, a completed one
	// refused with ErrKeyCompleted.
	ForceRelease Action = iota
	// Expire makes the key count as absent at once (ExpireSQL).
	Expire
)

// Plan returns the statement ($1 client, $2 key) that a runs on the key
// that ActSQL read (found false: no row), "" for none, or the error that
// ends a: ErrKeyNotFound for a key that is absent or expired,
// ErrKeyRunning for a running one unless running, ErrKeyCompleted for a
// completed one that ForceRelease was asked to release.
func (a Action) Plan(was idempotency.KeyInfo, found, running bool) (string, error) {
	switch {
	case !found || was.Expired:
		return "", idempotency.ErrKeyNotFound
	case was.Running() && !running:
		return "", idempotency.ErrKeyRunning
	case a == Expire:
		return ExpireSQL, nil
	case was.Status == idempotency.StatusCompleted:
		return "", idempotency.ErrKeyCompleted
	case was.Status == idempotency.StatusStarted:
		return ForceReleaseSQL, nil
	}
	return "", nil // released already
}

// Outcome is the answer of an action on the key that was, whose
// transaction ended with err: the key as it was, and err, or interpret(err)
// for an error that is not one of Plan's.
func Outcome(was idempotency.KeyInfo, err error, interpret func(error) error) (idempotency.KeyInfo, error) {
	switch {
	case errors.Is(err, idempotency.ErrKeyNotFound):
		return idempotency.KeyInfo{}, err
	case errors.Is(err, idempotency.ErrKeyRunning), errors.Is(err, idempotency.ErrKeyCompleted):
		return was, err
	}
	return was, interpret(err)
}

// StatsRow is the row of StatsSQL.
type StatsRow struct {
	Stats  idempotency.KeyStats
	Oldest int64 // microseconds
}

// Dests returns the scan destinations of the row's columns.
func (r *StatsRow) Dests() []any {
	return []any{&r.Stats.Running, &r.Oldest, &r.Stats.Lapsed, &r.Stats.ReleasedFailed}
}

// KeyStats is the statistics that the scanned row holds.
func (r *StatsRow) KeyStats() idempotency.KeyStats {
	st := r.Stats
	st.OldestRunning = time.Duration(r.Oldest) * time.Microsecond
	return st
}

// ListArgs returns the parameters of ListSQL for f, and false when f lists
// nothing (a status other than started or released, a client that is not
// valid text).
func ListArgs(f idempotency.ListFilter) ([]any, bool) {
	if (f.Status != idempotency.StatusStarted && f.Status != idempotency.StatusReleased) || CheckText(f.ClientID) != nil {
		return nil, false
	}
	return []any{string(f.Status), f.ClientID, Micros(max(f.OlderThan, 0)), f.EffectiveLimit()}, true
}

// AdoptArgs returns the parameters of AdoptKeySQL for the key k, found
// abandoned with grace, taken over with lease.
func AdoptArgs(k idempotency.KeyInfo, grace, lease time.Duration) []any {
	return []any{Micros(max(grace, 0)), k.ClientID, k.Key, k.Token, Micros(lease), string(k.Status)}
}
