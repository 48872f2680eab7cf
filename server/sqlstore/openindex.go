package sqlstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/idemkit/idem/server/internal/keysql"
)

// ErrNoOpenKeysIndex is returned by [Store.Abandoned], [Store.List] and
// [Store.Stats] (through an [idempotency.Sweeper] and
// [idempotency.Admin]) when the key table lacks the index that
// [CreateOpenKeysIndex] creates; the error says what is in its place, if
// anything. Nothing on a request's path needs the index, nor do
// [Store.Lookup], [Store.ForceRelease] and [Store.Expire].
var ErrNoOpenKeysIndex = errors.New("sqlstore: the key table has no valid idempotency_keys_open_idx, the index of the keys not completed, " +
	"which the sweeper's search for abandoned keys and the inspector's List and Stats need: create it with sqlstore.CreateOpenKeysIndex")

// CreateOpenKeysIndex creates idempotency_keys_open_idx, the index of the
// keys that are not completed, on the key table of [Migrate]: it is
// pgstore.CreateOpenKeysIndex, the same index, built the same way. A
// service that runs an [idempotency.Sweeper], or the inspector's lists and
// gauges ([idempotency.Admin]'s List and Stats), calls it at start after
// Migrate: [Store.Abandoned], [Store.List] and [Store.Stats] walk it, and
// without it they return [ErrNoOpenKeysIndex] rather than read the whole
// table at every sweep or scrape. A service that runs neither does not
// call it.
//
// What it costs the requests: one more index entry at each claim and each
// renewal, and no HOT completions (the index reads status and locked_at,
// which every renewal, completion and release changes, so none of them is
// a HOT update; see pgstore.CreateOpenKeysIndex for the figure).
//
// It builds the index with CREATE INDEX CONCURRENTLY, outside any
// transaction, which does not block the table's writes but waits for the
// transactions running in the database when it starts. A valid index is
// left alone, so a call at every start costs one catalog query once the
// index exists; an invalid one, left by an interrupted build, is dropped
// and built again; calls from many processes at once build it once, the
// build holding a transaction-level advisory lock in a READ COMMITTED
// transaction on another connection of db meanwhile. It needs two
// connections of db at once, so a db limited to one
// (SetMaxOpenConns(1)) is an error. Nothing is left on a session, so it
// works behind a pooler in transaction mode (docs/operations.md,
// "Poolers").
func CreateOpenKeysIndex(ctx context.Context, db *sql.DB) error {
	if db.Stats().MaxOpenConnections == 1 {
		return errors.New("sqlstore: creating the open keys' index: it needs two connections of db at once " +
			"(the build's, and its lock's transaction), and db allows one (SetMaxOpenConns(1)): call it on a *sql.DB of its own")
	}
	begin := func(ctx context.Context) (keysql.LockTx, error) {
		tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
		if err != nil {
			return nil, err
		}
		return lockTx{sqlConn{tx}, tx}, nil
	}
	if err := keysql.CreateOpenKeysIndex(ctx, sqlConn{db}, begin); err != nil {
		return fmt.Errorf("sqlstore: creating the open keys' index: %w", err)
	}
	return nil
}

// lockTx is a keysql.LockTx on database/sql.
type lockTx struct {
	sqlConn
	tx *sql.Tx
}

func (l lockTx) End(context.Context) error { return l.tx.Rollback() }

// needOpenIndex returns nil when the key table has the index that
// CreateOpenKeysIndex creates, and an error wrapping ErrNoOpenKeysIndex
// when not. Once it found the index, it costs nothing.
func (s *Store) needOpenIndex(ctx context.Context) error {
	err := s.openIndex.Need(ctx, sqlConn{s.db}, ErrNoOpenKeysIndex)
	if errors.Is(err, ErrNoOpenKeysIndex) {
		return err
	}
	return interpretError(err)
}
