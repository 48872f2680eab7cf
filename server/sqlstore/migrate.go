package sqlstore

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/idemkit/idem/server/internal/keysql"
)

// Migrate creates the key table of [Store], or brings it up to the version
// this package writes, in the first schema of the search_path of db's
// connections: the migrations of pgstore.Migrate, the same ones, so that
// either creates the table both serve (see pgstore.Migrate for the table
// and its columns). It touches nothing else. It runs in one transaction
// under a transaction-level advisory lock, so it is safe to call at every
// start, twice, and from many processes at once, on pgstore and on
// sqlstore alike.
func Migrate(ctx context.Context, db *sql.DB) (err error) {
	defer func() {
		if err != nil {
			err = fmt.Errorf("sqlstore: migrate: %w", err)
		}
	}()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback() //nolint:errcheck // after Commit, a no-op
	if err := keysql.Migrate(ctx, migrateConn{tx}); err != nil {
		return err
	}
	return tx.Commit()
}

// migrateConn runs keysql's migrations on a *sql.Tx.
type migrateConn struct{ tx *sql.Tx }

func (c migrateConn) Exec(ctx context.Context, query string, args ...any) error {
	_, err := c.tx.ExecContext(ctx, query, args...)
	return err
}

func (c migrateConn) QueryRow(ctx context.Context, query string, args []any, dest ...any) error {
	return c.tx.QueryRowContext(ctx, query, args...).Scan(dest...)
}
