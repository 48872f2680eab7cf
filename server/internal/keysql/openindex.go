package keysql

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"
)

// The open keys' index, idempotency_keys_open_idx: the keys that are not
// completed, by their last claim or renewal. The sweeper's search for
// abandoned keys (AbandonedSQL, which stops at the grace), the operators'
// lists (ListSQL) and the gauges' counts (StatsSQL) walk it, so their cost
// grows with the keys that are running, lapsed or released, not with the
// table. Migrate does not create it: it costs each claim and each renewal
// one more index entry, and, as it reads status and locked_at, no
// renewal, completion or release is a HOT update while it exists
// (pgstore's TestFinishIsHOT and TestOpenKeysIndexMakesNoUpdateHOT). A
// service that runs a sweeper or the inspector's lists and gauges creates
// it with CreateOpenKeysIndex; the stores' Abandoned, List and Stats
// refuse to run without it (OpenIndex.Need) rather than read the whole
// table at every sweep or scrape.
const (
	openIndexName = "idempotency_keys_open_idx"
	// openIndexOn is what the index covers, after ON and the table.
	openIndexOn = ` (locked_at) WHERE status <> 'completed'`
)

// openIndexLockClass is the first key of the advisory lock that
// CreateOpenKeysIndex holds while it builds the index; the second is a
// hash of the schema's name, as for Migrate's lock. It is not Migrate's: a
// Migrate waiting for it inside its transaction would keep the concurrent
// build waiting for that transaction's end.
const openIndexLockClass = migrateLockClass + 1

// openIndexPoll is how often CreateOpenKeysIndex tries the lock again
// while another caller builds the index. It never waits on the lock in a
// statement: a concurrent build waits for every transaction whose
// snapshot is older than its own, a statement blocked in
// pg_advisory_xact_lock's included, which would be a deadlock.
const openIndexPoll = 200 * time.Millisecond

// Index states, as openIndexStateSQL reports them.
const (
	indexValid   = "valid"
	indexInvalid = "invalid" // left by an interrupted concurrent build, or being built
	indexAbsent  = "absent"
	indexOther   = "other" // a relation of the name that is not an index of the key table
)

// openIndexStateSQL reports the state of the open keys' index in the
// current schema, the schema's name quoted for SQL, and its name as it
// is, for the build's lock.
const openIndexStateSQL = `
SELECT CASE WHEN r.oid IS NULL THEN '` + indexAbsent + `'
        WHEN i.indrelid IS DISTINCT FROM r.tab THEN '` + indexOther + `'
        WHEN i.indisvalid THEN '` + indexValid + `'
        ELSE '` + indexInvalid + `' END,
    coalesce(quote_ident(current_schema()), ''), coalesce(current_schema(), '')
FROM (SELECT to_regclass(quote_ident(current_schema()) || '.` + openIndexName + `') AS oid,
        to_regclass(quote_ident(current_schema()) || '.idempotency_keys') AS tab) r
LEFT JOIN pg_index i ON i.indexrelid = r.oid`

// openIndexState returns the state of the open keys' index (see
// openIndexStateSQL), the current schema, quoted, and its name.
func openIndexState(ctx context.Context, c Conn) (state, schema, name string, err error) {
	err = c.QueryRow(ctx, openIndexStateSQL, nil, &state, &schema, &name)
	return state, schema, name, err
}

// LockTx is a transaction at the READ COMMITTED level, begun for
// CreateOpenKeysIndex on a connection other than the one it builds on.
type LockTx interface {
	Conn
	// End rolls the transaction back, which releases its locks.
	End(ctx context.Context) error
}

// CreateOpenKeysIndex creates the open keys' index of the key table in
// the first schema of the search_path, with CREATE INDEX CONCURRENTLY, on
// c, outside any transaction. A valid index is left alone; an invalid one,
// left by a concurrent build that did not finish (it failed, was
// cancelled, or PostgreSQL stopped), is dropped, concurrently, and built
// again. The build does not block the table's writes; it waits for the
// transactions that were running in the database when it started to end.
//
// Concurrent calls build it once: each one takes a transaction-level
// advisory lock in a transaction of its own that begin begins (see
// LockTx), keeps that transaction open while it builds on c, and rolls it
// back after; the others wait for the lock, trying it again every
// openIndexPoll, and find the index valid. Nothing is held at the session
// level, on c or on the lock's connection: every statement on c may run
// on another session, as it does behind a pooler in transaction mode, and
// the lock ends with its transaction whatever becomes of the caller. The
// build does not wait for the lock's transaction: at READ COMMITTED, a
// transaction idle between two statements holds no snapshot, and it
// writes nothing.
func CreateOpenKeysIndex(ctx context.Context, c Conn, begin func(context.Context) (LockTx, error)) (err error) {
	state, _, name, err := openIndexState(ctx, c)
	if err != nil || state == indexValid {
		return err
	}
	lock, err := openIndexLock(ctx, begin, name)
	if err != nil {
		return err
	}
	// A rollback that fails leaves nothing held: the connection it failed
	// on is closed, and its session's locks go with it.
	defer lock.End(context.WithoutCancel(ctx)) //nolint:errcheck // see above
	// A replica of a release before this one may create the index in its
	// Migrate at the same time, with a plain CREATE INDEX that waits for
	// the build's lock while it holds a snapshot the build waits for:
	// PostgreSQL ends one of the two as a deadlock. Ours is tried again;
	// an invalid index it left is dropped and built anew.
	for attempt := 1; ; attempt++ {
		err = createOpenIndex(ctx, c)
		var st interface{ SQLState() string }
		if attempt == openIndexAttempts || !errors.As(err, &st) || st.SQLState() != DeadlockDetected || ctx.Err() != nil {
			return err
		}
	}
}

// openIndexAttempts bounds CreateOpenKeysIndex's builds that end in a
// deadlock.
const openIndexAttempts = 3

// createOpenIndex is CreateOpenKeysIndex under its lock.
func createOpenIndex(ctx context.Context, c Conn) error {
	// What another session did meanwhile.
	state, schema, _, err := openIndexState(ctx, c)
	if err != nil {
		return err
	}
	switch state {
	case indexValid:
		return nil
	case indexOther:
		return fmt.Errorf("a relation %s.%s that is not an index of idempotency_keys is in the way of the open keys' index: rename it", schema, openIndexName)
	case indexInvalid:
		if err := c.Exec(ctx, `DROP INDEX CONCURRENTLY IF EXISTS `+schema+`.`+openIndexName); err != nil {
			return fmt.Errorf("dropping the invalid %s left by an interrupted build: %w", openIndexName, err)
		}
	}
	// IF NOT EXISTS: a replica of a release before this one creates it in
	// its Migrate, which takes no advisory lock of ours.
	if err := c.Exec(ctx, `CREATE INDEX CONCURRENTLY IF NOT EXISTS `+openIndexName+` ON `+schema+`.idempotency_keys`+openIndexOn); err != nil {
		return fmt.Errorf("creating %s: %w", openIndexName, err)
	}
	if state, _, _, err = openIndexState(ctx, c); err == nil && state != indexValid {
		err = fmt.Errorf("%s is %s after its creation", openIndexName, state)
	}
	return err
}

// openIndexLock takes the advisory lock of CreateOpenKeysIndex for the
// schema named schema, in a transaction that begin begins, and returns
// that transaction, open. While another caller holds the lock, it tries
// again every openIndexPoll, each time in a new transaction, ended at
// once, so that it is never a transaction the other's build waits for.
func openIndexLock(ctx context.Context, begin func(context.Context) (LockTx, error), schema string) (LockTx, error) {
	for {
		tx, err := begin(ctx)
		if err != nil {
			return nil, err
		}
		var locked bool
		err = tx.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock($1, hashtext($2))`, []any{openIndexLockClass, schema}, &locked)
		if err == nil && locked {
			// The build must not wait for this transaction, so it must
			// hold no snapshot while it waits: a SELECT run in the
			// extended protocol (any statement with arguments) leaves its
			// portal open until the next statement, and the portal its
			// snapshot. This statement, sent without arguments, replaces
			// it, and keeps the lock from being ended by an
			// idle_in_transaction_session_timeout before the build is.
			if err = tx.Exec(ctx, `SET LOCAL idle_in_transaction_session_timeout = 0`); err == nil {
				return tx, nil
			}
		}
		_ = tx.End(context.WithoutCancel(ctx)) // see CreateOpenKeysIndex
		if err != nil {
			return nil, err
		}
		t := time.NewTimer(openIndexPoll)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, context.Cause(ctx)
		case <-t.C:
		}
	}
}

// OpenIndex is what a store knows of its key table's open keys' index:
// whether it was found valid. The zero value knows nothing. It is safe
// for concurrent use.
type OpenIndex struct{ valid atomic.Bool }

// Need returns nil when the key table has a valid open keys' index, and
// an error wrapping missing, which names the function that creates it,
// when not. It looks the index up in the catalog on c until it finds it
// valid, and never again after that.
func (o *OpenIndex) Need(ctx context.Context, c Conn, missing error) error {
	if o.valid.Load() {
		return nil
	}
	state, _, _, err := openIndexState(ctx, c)
	switch {
	case err != nil:
		return err
	case state == indexValid:
		o.valid.Store(true)
		return nil
	case state == indexInvalid:
		return fmt.Errorf("%w (an invalid one, left by an interrupted build or being built, is in its place)", missing)
	case state == indexOther:
		return fmt.Errorf("%w (a relation of its name that is not an index of the key table is in its place)", missing)
	}
	return missing
}
