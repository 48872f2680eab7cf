package main

import (
	"context"
	_ "embed"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/idemkit/idem/server/pgstore"
)

//go:embed schema.sql
var schemaSQL string

// migrateLock is the advisory lock that serialises migrate across the
// processes that start together (the service and its workers).
const migrateLock = 0x6f7574626f78 // "outbox"

// migrate creates, in the first schema of the search path, the key table
// (pgstore.Migrate), the orders table and River's tables (rivermigrate).
// Every role runs it at start; it is safe to run twice and at once.
func migrate(ctx context.Context, pool *pgxpool.Pool) error {
	if err := pgstore.Migrate(ctx, pool); err != nil {
		return fmt.Errorf("migrate the key table: %w", err)
	}
	// River applies each of its versions in a transaction of its own (some
	// cannot share one), so the lock is held by a session, on a connection
	// of its own, while they run on others.
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", int64(migrateLock)); err != nil {
		return err
	}
	defer conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", int64(migrateLock))
	if _, err := pool.Exec(ctx, schemaSQL); err != nil {
		return fmt.Errorf("migrate the orders table: %w", err)
	}
	migrator, err := rivermigrate.New(riverpgxv5.New(pool), nil)
	if err != nil {
		return err
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return fmt.Errorf("migrate River's tables: %w", err)
	}
	return nil
}
