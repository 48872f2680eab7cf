package pgstore_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/drivertest"
	"github.com/idemkit/idem/server/pgstore"
)

// openIndex returns the OID of idempotency_keys_open_idx in the pool's
// schema and whether it is valid; 0 when there is none.
func openIndex(t *testing.T, pool *pgxpool.Pool) (oid uint32, valid bool) {
	t.Helper()
	err := pool.QueryRow(context.Background(), `
		SELECT coalesce(i.indexrelid::oid, 0), coalesce(i.indisvalid, false)
		FROM (SELECT to_regclass('idempotency_keys_open_idx') AS oid) r
		LEFT JOIN pg_index i ON i.indexrelid = r.oid`).Scan(&oid, &valid)
	if err != nil {
		t.Fatal(err)
	}
	return oid, valid
}

// mustCreateOpenIndex runs CreateOpenKeysIndex and returns the index it
// leaves, which must be valid.
func mustCreateOpenIndex(t *testing.T, pool *pgxpool.Pool) uint32 {
	t.Helper()
	return mustCreateOpenIndexCtx(t, context.Background(), pool)
}

// mustCreateOpenIndexCtx is mustCreateOpenIndex with a context.
func mustCreateOpenIndexCtx(t *testing.T, ctx context.Context, pool *pgxpool.Pool) uint32 {
	t.Helper()
	if err := pgstore.CreateOpenKeysIndex(ctx, pool); err != nil {
		t.Fatalf("CreateOpenKeysIndex: %v", err)
	}
	oid, valid := openIndex(t, pool)
	if oid == 0 || !valid {
		t.Fatalf("after CreateOpenKeysIndex: index %d, valid %v; want a valid one", oid, valid)
	}
	return oid
}

// needIndex calls what needs the open keys' index on s, directly and
// through a Sweeper and an Admin, and returns their errors by name.
func needIndex(s *pgstore.Store) map[string]error {
	ctx := context.Background()
	sweeper := &idempotency.Sweeper{Store: s, Grace: time.Nanosecond, Logger: slog.New(slog.DiscardHandler),
		Settle: func(context.Context, idempotency.KeyInfo) (idempotency.Settlement, error) {
			return idempotency.Settlement{Release: true}, nil
		}}
	admin := &idempotency.Admin{Store: s, Logger: slog.New(slog.DiscardHandler)}
	errs := map[string]error{}
	_, errs["Abandoned"] = s.Abandoned(ctx, time.Nanosecond, 10)
	_, errs["List"] = s.List(ctx, idempotency.ListFilter{Status: idempotency.StatusReleased})
	_, errs["Stats"] = s.Stats(ctx)
	_, errs["Sweeper.Sweep"] = sweeper.Sweep(ctx)
	_, errs["Admin.List"] = admin.List(ctx, idempotency.ListFilter{Status: idempotency.StatusStarted})
	_, errs["Admin.Stats"] = admin.Stats(ctx)
	return errs
}

// TestOpenKeysIndexIsOptIn: Migrate leaves the open keys' index out; a
// sweeper's search, the inspector's lists and its stats then refuse with
// ErrNoOpenKeysIndex, naming the function that creates it, while claims,
// completions, releases, lookups, forced releases and expiries work.
// After CreateOpenKeysIndex the same store sweeps, lists and counts, in
// one statement each once it found the index; a second call and a second
// Migrate leave the index as it is.
func TestOpenKeysIndexIsOptIn(t *testing.T) {
	ctx := context.Background()
	trips := &roundTrips{}
	s, pool := newStore(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.Tracer = trips })
	if oid, _ := openIndex(t, pool); oid != 0 {
		t.Fatalf("Migrate created the open keys' index (%d), want none", oid)
	}
	mustComplete(t, s, mustClaim(t, s, req("done", "a"), idempotency.Claimed).Claim, "w-done")
	failed := mustClaim(t, s, leased(req("failed", "a"), time.Minute, time.Hour), idempotency.Claimed).Claim
	if err := s.Release(ctx, failed, idempotency.ReleaseFailed); err != nil {
		t.Fatal(err)
	}
	mustClaim(t, s, leased(req("running", "a"), time.Minute, time.Hour), idempotency.Claimed)
	if k, err := s.Lookup(ctx, "cli_a", "done", true); err != nil || k.Status != idempotency.StatusCompleted {
		t.Errorf("Lookup without the index = %+v, %v; want the completed key", k, err)
	}
	if _, err := s.ForceRelease(ctx, "cli_a", "running", true); err != nil {
		t.Errorf("ForceRelease without the index: %v", err)
	}
	if _, err := s.Expire(ctx, "cli_a", "done", false); err != nil {
		t.Errorf("Expire without the index: %v", err)
	}
	for name, err := range needIndex(s) {
		if !errors.Is(err, pgstore.ErrNoOpenKeysIndex) || !strings.Contains(err.Error(), "pgstore.CreateOpenKeysIndex") {
			t.Errorf("%s without the index: %v; want ErrNoOpenKeysIndex, naming pgstore.CreateOpenKeysIndex", name, err)
		}
	}

	oid := mustCreateOpenIndex(t, pool)
	for name, err := range needIndex(s) {
		if err != nil {
			t.Errorf("%s after CreateOpenKeysIndex: %v", name, err)
		}
	}
	before := trips.n.Load()
	if _, err := s.Abandoned(ctx, time.Nanosecond, 10); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Stats(ctx); err != nil {
		t.Fatal(err)
	}
	if n := trips.n.Load() - before; n != 2 {
		t.Errorf("Abandoned and Stats once the index was found: %d round trips, want 2 (the index not looked up again)", n)
	}
	mustCreateOpenIndex(t, pool)
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if again, valid := openIndex(t, pool); again != oid || !valid {
		t.Errorf("after CreateOpenKeysIndex and Migrate again: index %d (valid %v), want %d as it was", again, valid, oid)
	}
}

// TestCreateOpenKeysIndexAfterInterruptedBuild: a concurrent build that
// fails (here its statement_timeout, while a transaction writing to the
// key table keeps it waiting) leaves an invalid index; the store refuses
// to walk it, saying so, and the next CreateOpenKeysIndex drops it and
// builds a valid one. An index made invalid by hand is rebuilt alike.
func TestCreateOpenKeysIndexAfterInterruptedBuild(t *testing.T) {
	ctx := context.Background()
	s, pool := newStore(t, nil)
	writer, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer writer.Rollback(ctx)
	if _, err := writer.Exec(ctx, `LOCK TABLE idempotency_keys IN ROW EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	cfg := pool.Config().Copy()
	cfg.ConnConfig.RuntimeParams["statement_timeout"] = "500"
	short, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer short.Close()
	if err := pgstore.CreateOpenKeysIndex(ctx, short); err == nil {
		t.Fatal("CreateOpenKeysIndex while a writer keeps the build waiting past its statement_timeout: nil, want an error")
	}
	left, valid := openIndex(t, pool)
	if left == 0 || valid {
		t.Fatalf("after the interrupted build: index %d, valid %v; want an invalid one left", left, valid)
	}
	if _, err := s.Stats(ctx); !errors.Is(err, pgstore.ErrNoOpenKeysIndex) || !strings.Contains(err.Error(), "invalid") {
		t.Errorf("Stats on the invalid index: %v; want ErrNoOpenKeysIndex saying it is invalid", err)
	}
	if err := writer.Rollback(ctx); err != nil {
		t.Fatal(err)
	}

	rebuilt := mustCreateOpenIndex(t, pool)
	if rebuilt == left {
		t.Errorf("the invalid index %d was kept, want it dropped and built again", left)
	}
	if _, err := s.Stats(ctx); err != nil {
		t.Errorf("Stats after the rebuild: %v", err)
	}

	if _, err := pool.Exec(ctx, `UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'idempotency_keys_open_idx'::regclass`); err != nil {
		t.Fatal(err)
	}
	if again := mustCreateOpenIndex(t, pool); again == rebuilt {
		t.Errorf("the index made invalid by hand (%d) was kept, want it built again", rebuilt)
	}
}

// TestCreateOpenKeysIndexConcurrently: processes that start together all
// call it at once; each returns once the one index is built and valid.
func TestCreateOpenKeysIndexConcurrently(t *testing.T) {
	ctx := context.Background()
	pool := widePool(t, 8)
	if _, err := pool.Exec(ctx, drivertest.StartedKeysSQL); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make([]error, 6)
	valid := make([]bool, len(errs))
	for i := range errs {
		wg.Go(func() {
			if errs[i] = pgstore.CreateOpenKeysIndex(ctx, pool); errs[i] == nil {
				_, err := pgstore.New(pool).Stats(ctx)
				valid[i] = err == nil
			}
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil || !valid[i] {
			t.Errorf("call %d: %v, index valid on return: %v; want nil, true", i, err, valid[i])
		}
	}
	mustCreateOpenIndex(t, pool)
}

// TestCreateOpenKeysIndexRefusesAnotherRelation: a relation of the
// index's name that is not an index of the key table is an error naming
// it, and the store refuses to rely on it.
func TestCreateOpenKeysIndexRefusesAnotherRelation(t *testing.T) {
	ctx := context.Background()
	s, pool := newStore(t, nil)
	if _, err := pool.Exec(ctx, `CREATE TABLE idempotency_keys_open_idx (id int)`); err != nil {
		t.Fatal(err)
	}
	if err := pgstore.CreateOpenKeysIndex(ctx, pool); err == nil || !strings.Contains(err.Error(), "idempotency_keys_open_idx") {
		t.Errorf("CreateOpenKeysIndex with a table of its name in the way: %v, want an error naming it", err)
	}
	if _, err := s.Stats(ctx); !errors.Is(err, pgstore.ErrNoOpenKeysIndex) {
		t.Errorf("Stats with a table of the index's name: %v, want ErrNoOpenKeysIndex", err)
	}
}

// TestCreateOpenKeysIndexPoolOfOne: the build holds its lock in a
// transaction on a connection other than the one it builds on, which a
// pool of one connection does not have: it opens one of its own for it,
// and closes it after.
func TestCreateOpenKeysIndexPoolOfOne(t *testing.T) {
	ctx := context.Background()
	_, pool := newStore(t, func(cfg *pgxpool.Config) { cfg.MaxConns = 1 })
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	mustCreateOpenIndexCtx(t, cctx, pool)
	var sessions int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
		WHERE application_name = current_setting('application_name') AND pid <> pg_backend_pid()`).Scan(&sessions); err != nil {
		t.Fatal(err)
	}
	if sessions != 0 {
		t.Errorf("%d sessions besides the pool's one after CreateOpenKeysIndex; want its own closed", sessions)
	}
}
