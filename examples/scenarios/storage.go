package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"sync"
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
	store  server.Store // also a server.PaymentStore and server.ChargeStore
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
			s := &countingMemory{MemoryStore: server.NewMemoryStore()}
			return &storage{store: s, ledger: s}, nil
		},
	}
}

// countingMemory is a server.MemoryStore that remembers the payments it
// commits. server.MemoryStore can list its charges (Charges) but not its
// payments, so the payments are counted here: a payment is counted when the
// unit of work that staged it completes, which is exactly when the
// MemoryStore applies it.
type countingMemory struct {
	*server.MemoryStore

	mu       sync.Mutex
	payments []server.Payment
}

// Begin wraps the MemoryStore's unit of work to see its completion.
func (s *countingMemory) Begin(ctx context.Context, c server.Claim) (server.Tx, error) {
	tx, err := s.MemoryStore.Begin(ctx, c)
	if err != nil {
		return nil, err
	}
	return &countingTx{Tx: tx, store: s}, nil
}

// CreatePayment stages p on the MemoryStore's own unit of work.
func (s *countingMemory) CreatePayment(ctx context.Context, tx server.Tx, p server.Payment) error {
	ct, ok := tx.(*countingTx)
	if !ok {
		return fmt.Errorf("scenarios: CreatePayment got a %T, not a unit of work of this store", tx)
	}
	if err := s.MemoryStore.CreatePayment(ctx, ct.Tx, p); err != nil {
		return err
	}
	ct.mu.Lock()
	ct.staged = append(ct.staged, p)
	ct.mu.Unlock()
	return nil
}

// Payments implements ledger.
func (s *countingMemory) Payments(_ context.Context, customer string) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, p := range s.payments {
		if customer == "" || p.Customer == customer {
			n++
		}
	}
	return n, nil
}

// Charges implements ledger.
func (s *countingMemory) Charges(context.Context) (int, error) {
	return len(s.MemoryStore.Charges()), nil
}

// countingTx is a MemoryStore unit of work whose staged payments are
// counted once it completes.
type countingTx struct {
	server.Tx
	store *countingMemory

	mu     sync.Mutex
	staged []server.Payment
}

// Complete implements server.Tx.
func (tx *countingTx) Complete(ctx context.Context, resp server.StoredResponse) error {
	if err := tx.Tx.Complete(ctx, resp); err != nil {
		return err
	}
	tx.mu.Lock()
	staged := tx.staged
	tx.staged = nil
	tx.mu.Unlock()
	tx.store.mu.Lock()
	tx.store.payments = append(tx.store.payments, staged...)
	tx.store.mu.Unlock()
	return nil
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
			store:  server.NewPostgresStore(pool),
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
