package pgstore

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/server/internal/keysql"
)

// ErrNoOpenKeysIndex is returned by [Store.Abandoned], [Store.List] and
// [Store.Stats] (through an [idempotency.Sweeper] and
// [idempotency.Admin]) when the key table lacks the index that
// [CreateOpenKeysIndex] creates; the error says what is in its place, if
// anything. Nothing on a request's path needs the index, nor do
// [Store.Lookup], [Store.ForceRelease] and [Store.Expire].
var ErrNoOpenKeysIndex = errors.New("pgstore: the key table has no valid idempotency_keys_open_idx, the index of the keys not completed, " +
	"which the sweeper's search for abandoned keys and the inspector's List and Stats need: create it with pgstore.CreateOpenKeysIndex")

// CreateOpenKeysIndex creates idempotency_keys_open_idx, the index of the
// keys that are not completed, by their last claim or renewal, on the key
// table of [Migrate] (pool's search_path decides the schema, as for
// Migrate). A service that runs an [idempotency.Sweeper], or the
// inspector's lists and gauges ([idempotency.Admin]'s List and Stats),
// calls it at start after Migrate: [Store.Abandoned], [Store.List] and
// [Store.Stats] walk it, so their cost grows with the keys that are
// running, lapsed or released rather than with the table, and without it
// they return [ErrNoOpenKeysIndex] rather than read the whole table at
// every sweep or scrape. A service that runs neither does not call it.
//
// What it costs the requests: one more index entry at each claim and each
// renewal, and no HOT completions. The index reads status and locked_at,
// which every renewal, completion and release changes, so PostgreSQL
// writes each of them as a new row version with new entries in every
// index of the table, never as a HOT update on the row's own page. In
// BENCHMARKS.md's comparison with the seed article by hand (issue 21),
// dropping it took the CPU of a payment's first execution from 1.247 to
// 1.062 ms.
//
// It builds the index with CREATE INDEX CONCURRENTLY, which does not block
// the table's writes (a plain CREATE INDEX would, for as long as it reads
// a large table) but waits for the transactions running in the database
// when it starts, and cannot run in a transaction: it runs on a connection
// of its own from pool. An index that is there and valid is left alone,
// so a call at every start costs one catalog query once the index exists.
// An invalid one, left by a build that did not finish (it failed, was
// cancelled, or PostgreSQL stopped), is dropped, concurrently, and built
// again. Calls from
// many processes at once build it once: each waits for the build under
// way, under a session-level advisory lock, and finds it done. To remove
// the index: DROP INDEX CONCURRENTLY idempotency_keys_open_idx.
func CreateOpenKeysIndex(ctx context.Context, pool *pgxpool.Pool) error {
	c, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("pgstore: creating the open keys' index: %w", err)
	}
	if err = keysql.CreateOpenKeysIndex(ctx, sqlConn{c}); err != nil {
		// The session may still hold the build's advisory lock.
		_ = c.Hijack().Close(context.WithoutCancel(ctx))
		return fmt.Errorf("pgstore: creating the open keys' index: %w", err)
	}
	c.Release()
	return nil
}

// needOpenIndex returns nil when the key table has the index that
// CreateOpenKeysIndex creates, and an error wrapping ErrNoOpenKeysIndex
// when not. Once it found the index, it costs nothing.
func (s *Store) needOpenIndex(ctx context.Context) error {
	err := s.openIndex.Need(ctx, sqlConn{s.pool}, ErrNoOpenKeysIndex)
	if errors.Is(err, ErrNoOpenKeysIndex) {
		return err
	}
	return interpretError(err)
}
