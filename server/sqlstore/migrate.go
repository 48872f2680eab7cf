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
// and its columns). It touches nothing else, and leaves the index that a
// sweeper and the inspector's lists and gauges need to
// [CreateOpenKeysIndex], neither creating nor dropping it. It runs in one transaction
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
	if err := keysql.Migrate(ctx, sqlConn{tx}); err != nil {
		return err
	}
	return tx.Commit()
}

// sqlConn runs keysql's migrations and catalog queries (keysql.Conn) on a
// *sql.Tx, a *sql.Conn or the *sql.DB.
type sqlConn struct {
	db interface {
		ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
		QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
	}
}

func (c sqlConn) Exec(ctx context.Context, query string, args ...any) error {
	_, err := c.db.ExecContext(ctx, query, args...)
	return err
}

func (c sqlConn) QueryRow(ctx context.Context, query string, args []any, dest ...any) error {
	return c.db.QueryRowContext(ctx, query, args...).Scan(dest...)
}
