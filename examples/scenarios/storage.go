package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/server"
)

// A backend makes the storage of each scenario's server: every scenario
// runs against a fresh, empty store, so its counts are its own.
type backend struct {
	name string // for the header: "memory store", "PostgreSQL 127.0.0.1:5432/postgres"
	open func(ctx context.Context, scenario string) (*storage, error)
}

// storage is what one scenario's server keeps its keys, payments and
// charges in, and how the scenario counts them afterwards.
type storage struct {
	store  server.Storage
	ledger ledger
	close  func() error // nil: nothing to release
}

// ledger counts what a server really stored, to check a scenario's
// invariants against the store rather than against what the client saw.
type ledger interface {
	// Payments counts the committed payments of customer, or of everyone
	// when customer is empty.
	Payments(ctx context.Context, customer string) (int, error)
	// Charges counts the charges the card processor made.
	Charges(ctx context.Context) (int, error)
}

// memoryBackend gives each scenario a new in-memory store.
func memoryBackend() backend {
	return backend{
		name: "memory store",
		open: func(context.Context, string) (*storage, error) {
			s := server.NewMemoryStorage()
			return &storage{store: s.Storage(), ledger: memLedger{s}}, nil
		},
	}
}

// memLedger counts what a server.MemoryStorage committed.
type memLedger struct{ s *server.MemoryStorage }

// Payments implements ledger.
func (l memLedger) Payments(_ context.Context, customer string) (int, error) {
	n := 0
	for _, p := range l.s.Payments() {
		if customer == "" || p.Customer == customer {
			n++
		}
	}
	return n, nil
}

// Charges implements ledger.
func (l memLedger) Charges(context.Context) (int, error) {
	return len(l.s.Charges()), nil
}

// pgLedger counts rows in the tables of one migrated schema.
type pgLedger struct{ pool *pgxpool.Pool }

// Payments implements ledger.
func (l pgLedger) Payments(ctx context.Context, customer string) (int, error) {
	var n int
	err := l.pool.QueryRow(ctx, `SELECT count(*) FROM payments WHERE $1 = '' OR customer_id = $1`, customer).Scan(&n)
	return n, err
}

// Charges implements ledger.
func (l pgLedger) Charges(ctx context.Context) (int, error) {
	var n int
	err := l.pool.QueryRow(ctx, `SELECT count(*) FROM charges`).Scan(&n)
	return n, err
}

// schemaPrefix starts the name of every schema the runner creates.
const schemaPrefix = "idem_scenarios_"

// postgresBackend connects to the database at url and gives each scenario
// a schema of its own, named idem_scenarios_<run>_<scenario>, migrated
// with server.Migrate and dropped when the scenario ends, so runs never
// see each other's rows or leave any behind. Close the returned pool when
// the run ends.
func postgresBackend(ctx context.Context, url string) (backend, *pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return backend{}, nil, fmt.Errorf("-database-url: %w", err)
	}
	admin, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return backend{}, nil, fmt.Errorf("-database-url: %w", err)
	}
	if err := admin.Ping(ctx); err != nil {
		admin.Close()
		return backend{}, nil, fmt.Errorf("-database-url: connecting to PostgreSQL: %w", err)
	}
	var run [4]byte
	_, _ = rand.Read(run[:])
	runID := hex.EncodeToString(run[:])
	name := fmt.Sprintf("PostgreSQL %s:%d/%s, a schema per scenario", cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.Database)
	open := func(ctx context.Context, scenario string) (*storage, error) {
		schema := schemaPrefix + runID + "_" + identifier(scenario)
		ident := pgx.Identifier{schema}.Sanitize()
		if _, err := admin.Exec(ctx, "CREATE SCHEMA "+ident); err != nil {
			return nil, fmt.Errorf("creating schema %s: %w", schema, err)
		}
		drop := func() error {
			ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			defer cancel()
			if _, err := admin.Exec(ctx, "DROP SCHEMA IF EXISTS "+ident+" CASCADE"); err != nil {
				return fmt.Errorf("dropping schema %s: %w", schema, err)
			}
			return nil
		}
		pcfg := cfg.Copy()
		pcfg.ConnConfig.RuntimeParams["search_path"] = schema
		pool, err := pgxpool.NewWithConfig(ctx, pcfg)
		if err != nil {
			return nil, errors.Join(err, drop())
		}
		if err := server.Migrate(ctx, pool); err != nil {
			pool.Close()
			return nil, errors.Join(err, drop())
		}
		return &storage{
			store:  server.NewPostgresStorage(pool).Storage(),
			ledger: pgLedger{pool},
			close: func() error {
				pool.Close()
				return drop()
			},
		}, nil
	}
	return backend{name: name, open: open}, admin, nil
}

var nonIdent = regexp.MustCompile(`[^a-z0-9]+`)

// identifier turns a scenario name into a plain SQL identifier.
func identifier(s string) string {
	return strings.Trim(nonIdent.ReplaceAllString(strings.ToLower(s), "_"), "_")
}
