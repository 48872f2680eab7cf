package idempotency

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"
)

// Errors of an [Inspector] and of [Admin].
var (
	// ErrKeyNotFound: no such key is stored, or it expired (an expired
	// key counts as absent, see [ClaimRequest.Retention]).
	ErrKeyNotFound = errors.New("idempotency: no such key")
	// ErrKeyRunning: the key's request is running (started, its lease
	// live, or a lease that never runs out), and the action was not asked
	// to apply to a running key. Acting anyway fences the running owner:
	// its renewals, completion and release fail with [ErrFenced], and its
	// writes are rolled back.
	ErrKeyRunning = errors.New("idempotency: the key's request is running")
	// ErrKeyCompleted: the key holds a stored outcome, which a release
	// would discard (a retry would run the operation again). Expire it
	// instead if it must go.
	ErrKeyCompleted = errors.New("idempotency: the key is completed")
	// ErrNotInspectable is returned by [Admin] on a [Store] that does not
	// implement [Inspector].
	ErrNotInspectable = errors.New("idempotency: the store does not implement Inspector")
)

// KeyInfo is a stored key as an operator sees it. It never holds the
// stored response's body unless asked for it.
type KeyInfo struct {
	ClientID string
	Key      string
	Method   string
	Path     string
	Status   Status
	// ReleaseKind is the kind of the last release, when Status is
	// StatusReleased: [ReleaseFailed] (only a retry of the same request,
	// or the [Sweeper], may claim it) or [ReleaseRejected].
	ReleaseKind ReleaseKind
	OperationID string
	Token       int64     // the fencing token of the current (or last) owner
	CreatedAt   time.Time // when its operation began
	LockedAt    time.Time // the last claim or renewal of its lease
	// FinishedAt is when the key was completed or released, as its expiry
	// tells (ExpiresAt less Retention); zero while it is started, and for
	// a key kept forever (no Retention), whose finish is not stored.
	FinishedAt time.Time
	ExpiresAt  time.Time     // when it starts counting as absent; zero: never
	Lease      time.Duration // the owner's lease; zero: never runs out
	Retention  time.Duration // how long it is kept once finished; zero: forever
	// LeaseAge is how long ago, by the store's clock, LockedAt was.
	LeaseAge time.Duration
	// Lapsed: started, and its lease ran out; its owner stopped renewing
	// it (crashed, or cut off from the store). A retry of the same request
	// takes it over, and a [Sweeper] settles it after its grace.
	Lapsed bool
	// Expired: it counts as absent already, though the purge has not
	// deleted it yet. Only [Inspector.Lookup] returns such keys.
	Expired bool
	// Response is the stored outcome of a completed key: its Body only
	// when asked for ([Inspector.Lookup] with body).
	Response *StoredResponse
}

// Running reports whether k's request is running: started, with a lease
// that did not run out (or never does).
func (k KeyInfo) Running() bool { return k.Status == StatusStarted && !k.Lapsed && !k.Expired }

// ListFilter selects the keys [Inspector.List] returns.
type ListFilter struct {
	// Status is StatusStarted (keys whose request runs, or whose owner
	// died) or StatusReleased (keys awaiting a retry); other values
	// list nothing.
	Status Status
	// OlderThan keeps started keys whose operation began at least this
	// long ago, and released keys released at least this long ago (by
	// FinishedAt, or LockedAt when that is not stored). Zero: all.
	OlderThan time.Duration
	// ClientID keeps the keys of one client. Empty: every client.
	ClientID string
	// Limit caps the keys returned, the oldest first. If zero,
	// [DefaultListLimit] (100) is used; at most [MaxListLimit] (1000).
	Limit int
}

// Limits of [ListFilter.Limit].
const (
	DefaultListLimit = 100  // the limit of a filter that sets none
	MaxListLimit     = 1000 // the highest limit a store honours
)

// EffectiveLimit returns the number of keys a store's List returns at
// most for f: [ListFilter.Limit] with its default and cap applied.
func (f ListFilter) EffectiveLimit() int {
	return min(cmp.Or(max(f.Limit, 0), DefaultListLimit), MaxListLimit)
}

// KeyStats counts the keys that are not finished, for gauges.
type KeyStats struct {
	// Running counts the started keys whose request runs (lease live).
	Running int64
	// OldestRunning is how long ago the operation of the oldest running
	// key began; zero when none runs.
	OldestRunning time.Duration
	// Lapsed counts the started keys whose lease ran out, not yet
	// expired: their owner died, and neither a retry nor a [Sweeper] has
	// taken them over yet.
	Lapsed int64
	// ReleasedFailed counts the keys released as [ReleaseFailed], not
	// yet expired: awaiting the retry of their request, or the [Sweeper].
	ReleasedFailed int64
}

// Inspector is the operators' view of a [Store]: look keys up, list the
// stuck ones, and release or expire one by hand. [MemoryStore] and the
// PostgreSQL stores (packages pgstore and sqlstore) implement it; [Admin]
// uses it, and logs and reports what it changes. A store need not
// implement it to serve [Middleware]. The PostgreSQL stores' List and
// Stats need an index that their CreateOpenKeysIndex creates, and return
// an error saying so without it.
//
// Every method uses the store's clock, as its claims do.
type Inspector interface {
	// Lookup returns the key of clientID, or [ErrKeyNotFound]. A key that
	// expired but is not purged yet is returned, Expired. The stored
	// response's body is left out unless body is true.
	Lookup(ctx context.Context, clientID, key string, body bool) (KeyInfo, error)
	// List returns the keys f selects, oldest first, never expired ones,
	// never with a response body.
	List(ctx context.Context, f ListFilter) ([]KeyInfo, error)
	// ForceRelease releases a started key as [ReleaseFailed], whoever owns
	// it, and returns it as it was: the retry of its request claims it at
	// once, under the same operation, and a [Sweeper] settles it if none
	// comes. The key is released under a new fencing token, so its owner,
	// if it still runs, is fenced. A running key (see [KeyInfo.Running])
	// is refused with [ErrKeyRunning] unless running is true; a completed
	// one with [ErrKeyCompleted]; an absent or expired one with
	// [ErrKeyNotFound]. A key already released is left as it is, with no
	// error.
	ForceRelease(ctx context.Context, clientID, key string, running bool) (KeyInfo, error)
	// Expire makes a key count as absent at once, whatever its status,
	// and returns it as it was: the next request with it is a new
	// operation, unless it says it was first sent before the key's
	// operation began (see [ClaimRequest.FirstSent]): a retry of that
	// operation is refused. The purge keeps the key, expired, until its
	// Retention has passed since its operation began ([KeyInfo.CreatedAt]),
	// and deletes it after, when such a retry was first sent longer ago
	// than the key is kept, and is refused without it (see [Store.Purge]);
	// a key kept forever is purged at once. Its owner, if it still runs,
	// is fenced. A running key is refused with [ErrKeyRunning] unless
	// running is true; an absent or already expired one with
	// [ErrKeyNotFound].
	Expire(ctx context.Context, clientID, key string, running bool) (KeyInfo, error)
	// Stats counts the keys that are not finished.
	Stats(ctx context.Context) (KeyStats, error)
}

// Admin is what an operator does with the keys of a [Store] that
// implements [Inspector]: look them up, list the stuck ones, and release or
// expire one, giving a reason that is logged (at Warn) and reported as an
// [Event]. Its zero value needs a Store. An Admin is safe for concurrent
// use.
type Admin struct {
	// Store holds the keys; it must implement [Inspector], or every method
	// returns [ErrNotInspectable].
	Store Store
	// Logger receives a line per action that changed a key. If nil,
	// [slog.Default] is used.
	Logger *slog.Logger
	// OnEvent, if not nil, is called with [EventForceReleased] or
	// [EventExpired] for each key an action changed.
	OnEvent func(Event)
}

func (a *Admin) inspector() (Inspector, error) {
	if in, ok := a.Store.(Inspector); ok {
		return in, nil
	}
	return nil, fmt.Errorf("%w (%T)", ErrNotInspectable, a.Store)
}

func (a *Admin) logger() *slog.Logger { return cmp.Or(a.Logger, slog.Default()) }

// Lookup returns the key of clientID (see [Inspector.Lookup]).
func (a *Admin) Lookup(ctx context.Context, clientID, key string, body bool) (KeyInfo, error) {
	in, err := a.inspector()
	if err != nil {
		return KeyInfo{}, err
	}
	return in.Lookup(ctx, clientID, key, body)
}

// List returns the keys f selects (see [Inspector.List]).
func (a *Admin) List(ctx context.Context, f ListFilter) ([]KeyInfo, error) {
	in, err := a.inspector()
	if err != nil {
		return nil, err
	}
	return in.List(ctx, f)
}

// Stats counts the keys that are not finished (see [Inspector.Stats]).
func (a *Admin) Stats(ctx context.Context) (KeyStats, error) {
	in, err := a.inspector()
	if err != nil {
		return KeyStats{}, err
	}
	return in.Stats(ctx)
}

// errNoReason is returned for an action without a reason.
var errNoReason = errors.New("idempotency: an operator's action needs a reason")

// ForceRelease releases a started key (see [Inspector.ForceRelease]) and
// returns it as it was. reason, required, is logged with the key and the
// operator's choice of running; the release is reported as
// [EventForceReleased]. A key that was already released is left as it is,
// and neither logged nor reported.
func (a *Admin) ForceRelease(ctx context.Context, clientID, key, reason string, running bool) (KeyInfo, error) {
	return a.act(ctx, clientID, key, reason, running, EventForceReleased)
}

// Expire makes a key count as absent at once (see [Inspector.Expire]) and
// returns it as it was. reason, required, is logged with the key; the
// expiry is reported as [EventExpired]. A retry of the key's operation,
// which says it was first sent before the operation began, is refused
// (410) for good: the purge keeps the key until the retry is too old to
// be let in without it.
func (a *Admin) Expire(ctx context.Context, clientID, key, reason string, running bool) (KeyInfo, error) {
	return a.act(ctx, clientID, key, reason, running, EventExpired)
}

// act runs ForceRelease (e is EventForceReleased) or Expire.
func (a *Admin) act(ctx context.Context, clientID, key, reason string, running bool, e Event) (KeyInfo, error) {
	if reason == "" {
		return KeyInfo{}, errNoReason
	}
	in, err := a.inspector()
	if err != nil {
		return KeyInfo{}, err
	}
	do, what := in.Expire, "idempotency: operator expired a key"
	if e == EventForceReleased {
		do, what = in.ForceRelease, "idempotency: operator released a key"
	}
	was, err := do(ctx, clientID, key, running)
	if err != nil {
		return was, err
	}
	if e == EventForceReleased && was.Status == StatusReleased {
		return was, nil // nothing changed
	}
	a.logger().Warn(what, "client", clientID, "key", key, "reason", reason,
		"status", was.Status, "running", was.Running(), "operation", was.OperationID, "token", was.Token)
	if a.OnEvent != nil {
		a.OnEvent(e)
	}
	return was, nil
}
