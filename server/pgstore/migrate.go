package pgstore

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/server/internal/keysql"
)

// Migrate creates the key table of [Store], or brings it up to the version
// this package writes, in the first schema of the search_path of pool's
// connections. It touches nothing else: it creates the sequence
// idempotency_lock_tokens, the table idempotency_keys with its primary key
// and its index idempotency_keys_expires_idx, and the table idempotency_migrations,
// where it records the version it applied. The index that a sweeper and
// the inspector's lists and gauges need is [CreateOpenKeysIndex]'s, on
// request; Migrate neither creates nor drops it, so a table that has it
// from an earlier release keeps it. The business tables of the service are
// the service's to create. The migrations are those of sqlstore.Migrate:
// the two packages serve one key table, side by side.
//
// It runs in one transaction under a transaction-level advisory lock, so it
// is safe to call at every start, twice, and from many processes at once:
// one applies what is missing, the others wait for it and find nothing to
// do. A table named idempotency_keys that it did not create is an error
// naming the columns that differ, never silently used.
//
// The version recorded is the table's format; a replica refuses to start
// on a newer one. Changes that replicas of the same format keep working
// with (a default, say) do not change it: Migrate applies each one the
// table lacks, so a replica of the previous release restarted during a
// rolling upgrade still starts.
//
// The key table, for operators: one row per (client_id, idempotency_key),
// the primary key. status is started, completed or released; a started row
// is owned by lock_token, whose lease of lease_us microseconds was renewed
// at locked_at; a finished row (completed or released) finished at
// locked_at; a completed row holds the response replayed to retries
// (response_status, response_content_type, response_headers as a JSON
// object, response_body byte for byte). A key starts counting as absent
// retention_us after its request finished, or, while started, retention_us
// after its lease runs out, and never with a retention of 0, nor while
// started with a lease of 0: at greatest(expires_at, locked_at +
// retention_us, plus lease_us while started). expires_at is a bound below
// that time (the claim's time plus the retention; NULL: never), kept as it
// is when a key is renewed, completed or released, so that these updates
// leave the primary key's and expires_at's indexes unchanged. The purge
// ([Store.Purge]) deletes the rows that
// count as absent, through idempotency_keys_expires_idx, in bounded
// batches; it never deletes a row whose lease is being renewed.
//
// First, it checks that pool's query mode works with the way its
// connections reach PostgreSQL ([CheckQueryMode]): behind a pooler in
// transaction mode, pgx's default mode cannot work, and Migrate returns a
// [*QueryModeError] that says what to set, also when a statement of its
// own shows it.
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	if err := CheckQueryMode(ctx, pool); err != nil {
		return err
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return keysql.Migrate(ctx, sqlConn{tx})
	})
	if err != nil {
		return fmt.Errorf("pgstore: migrate: %w", queryModeError(pool, err))
	}
	return nil
}

// sqlConn runs keysql's migrations and catalog queries (keysql.Conn) on a
// pgx.Tx, a connection or the pool.
type sqlConn struct {
	db interface {
		Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
		QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	}
}

func (c sqlConn) Exec(ctx context.Context, sql string, args ...any) error {
	_, err := c.db.Exec(ctx, sql, args...)
	return err
}

func (c sqlConn) QueryRow(ctx context.Context, sql string, args []any, dest ...any) error {
	return c.db.QueryRow(ctx, sql, args...).Scan(dest...)
}
