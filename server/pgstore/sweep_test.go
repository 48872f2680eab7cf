package pgstore_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
	"github.com/idemkit/idem/server/storetest"
)

// backend is a store on a pool of its own, its key table with the open
// keys' index that the sweeper and the inspector need, its business
// writes rows inserted through the request's transaction (TxFromContext).
func backend(t *testing.T) storetest.Backend {
	pool := widePool(t, 8)
	if err := pgstore.CreateOpenKeysIndex(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	return storetest.Backend{
		Store: pgstore.New(pool),
		Write: write,
		Written: func(ctx context.Context, name string) (bool, error) {
			return written(ctx, pool, name)
		},
		Elapse: elapseAll(pool),
	}
}

// TestSweeperConformance runs the sweeper's conformance suite on pgstore.
func TestSweeperConformance(t *testing.T) {
	storetest.ExerciseSweeper(t, backend)
}

// TestInspectorConformance runs the operators' conformance suite on
// pgstore.
func TestInspectorConformance(t *testing.T) {
	storetest.ExerciseInspector(t, backend)
}

// TestLifecycleQueriesWalkTheOpenIndex fills the key table with completed
// keys and a few unfinished ones, then checks that the sweeper's search,
// the operators' list and the gauges' counts find the unfinished ones
// through idempotency_keys_open_idx, which CreateOpenKeysIndex made, never
// by scanning the table.
func TestLifecycleQueriesWalkTheOpenIndex(t *testing.T) {
	ctx := context.Background()
	rec := &sqlRecorder{}
	s, pool := newStore(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.Tracer = rec })
	// 20000 completed keys, and 30 started ones whose lease (1s) ran out a
	// day ago: every key claimed two days ago, kept for a week.
	const completed, lapsed = 20000, 30
	if _, err := pool.Exec(ctx, `
		INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path, request_hash,
			status, operation_id, lock_token, response_status, created_at, locked_at,
			lease_us, retention_us, expires_at)
		SELECT 'cli_a', 'key-' || g, 'POST', '/v1/orders', '\x00',
			CASE WHEN g <= $2 THEN 'started' ELSE 'completed' END, gen_random_uuid(),
			nextval('idempotency_lock_tokens'), CASE WHEN g <= $2 THEN NULL ELSE 201 END,
			now() - interval '2 days', now() - interval '2 days', 1000000, 604800000000,
			now() + interval '5 days'
		FROM generate_series(1, $1::int) g`, completed+lapsed, lapsed); err != nil {
		t.Fatal(err)
	}
	if err := pgstore.CreateOpenKeysIndex(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `ANALYZE idempotency_keys`); err != nil {
		t.Fatal(err)
	}
	explain := func(what string) {
		t.Helper()
		q, ok := rec.last("SELECT")
		if !ok {
			t.Fatalf("%s ran no SELECT", what)
		}
		rows, err := pool.Query(ctx, "EXPLAIN "+q.SQL, q.Args...)
		if err != nil {
			t.Fatal(err)
		}
		plan, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		if text := strings.Join(plan, "\n"); strings.Contains(text, "Seq Scan") || !strings.Contains(text, "idempotency_keys_open_idx") {
			t.Errorf("%s's plan scans the table or skips the open keys' index:\n%s", what, text)
		}
	}

	ks, err := s.Abandoned(ctx, time.Hour, 100)
	if err != nil || len(ks) != lapsed {
		t.Fatalf("Abandoned = %d keys, %v; want %d", len(ks), err, lapsed)
	}
	explain("Abandoned")
	listed, err := s.List(ctx, idempotency.ListFilter{Status: idempotency.StatusStarted, OlderThan: time.Hour})
	if err != nil || len(listed) != lapsed {
		t.Fatalf("List = %d keys, %v; want %d", len(listed), err, lapsed)
	}
	explain("List")
	st, err := s.Stats(ctx)
	if err != nil || st.Lapsed != lapsed || st.Running != 0 {
		t.Fatalf("Stats = %+v, %v; want %d lapsed, none running", st, err, lapsed)
	}
	explain("Stats")
}
