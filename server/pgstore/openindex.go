package pgstore

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
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
// index of the table, never as a HOT update on the row's own page, which
// costs every first execution (bench/NOTES.md has the measurement).
//
// It builds the index with CREATE INDEX CONCURRENTLY, which does not block
// the table's writes (a plain CREATE INDEX would, for as long as it reads
// a large table) but waits for the transactions running in the database
// when it starts, and cannot run in a transaction: it runs its statements
// on pool, outside any transaction. An index that is there and valid is
// left alone, so a call at every start costs one catalog query once the
// index exists. An invalid one, left by a build that did not finish (it
// failed, was cancelled, or PostgreSQL stopped), is dropped, concurrently,
// and built again. Calls from many processes at once build it once: each
// waits for the build under way, which holds a transaction-level advisory
// lock in a READ COMMITTED transaction of its own on another connection of
// pool (one connection more, outside the pool, when the pool has only
// one), and finds it done. Nothing is left on a session, so it works
// behind a pooler in transaction mode (docs/operations.md, "Poolers"). To
// remove the index: DROP INDEX CONCURRENTLY idempotency_keys_open_idx.
func CreateOpenKeysIndex(ctx context.Context, pool *pgxpool.Pool) error {
	if err := keysql.CreateOpenKeysIndex(ctx, sqlConn{pool}, lockTxOn(pool)); err != nil {
		return fmt.Errorf("pgstore: creating the open keys' index: %w", queryModeError(pool, err))
	}
	return nil
}

// lockTxOn returns the function that begins CreateOpenKeysIndex's
// transactions for its lock: on a connection of pool, or, when the pool
// has one connection only, which the build needs meanwhile, on a
// connection of their own.
func lockTxOn(pool *pgxpool.Pool) func(context.Context) (keysql.LockTx, error) {
	opts := pgx.TxOptions{IsoLevel: pgx.ReadCommitted}
	return func(ctx context.Context) (keysql.LockTx, error) {
		if pool.Stat().MaxConns() > 1 {
			tx, err := pool.BeginTx(ctx, opts)
			if err != nil {
				return nil, err
			}
			return lockTx{sqlConn{tx}, tx, nil}, nil
		}
		conn, err := connect(ctx, pool)
		if err != nil {
			return nil, err
		}
		tx, err := conn.BeginTx(ctx, opts)
		if err != nil {
			conn.Close(context.WithoutCancel(ctx))
			return nil, err
		}
		return lockTx{sqlConn{tx}, tx, conn}, nil
	}
}

// lockTx is a keysql.LockTx on pgx: a transaction, and the connection of
// its own it runs on, if any, closed when it ends.
type lockTx struct {
	sqlConn
	tx   pgx.Tx
	conn *pgx.Conn
}

func (l lockTx) End(ctx context.Context) error {
	err := l.tx.Rollback(ctx)
	if l.conn != nil {
		err = errors.Join(err, l.conn.Close(ctx))
	}
	return err
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
