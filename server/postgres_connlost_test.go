package server_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server"
)

// terminator is a pgx tracer that ends, with pg_terminate_backend, the
// backend that the first statement starting with prefix is about to be
// sent to: PostgreSQL ends the connection under the statement, as a
// restart or an administrator would. Before that, meanwhile (if not nil)
// runs on another connection, to play what happened in the database out
// of the caller's sight: the lost statement itself, committed, or a
// concurrent takeover.
type terminator struct {
	t         *testing.T
	dsn       string
	prefix    string
	meanwhile func(ctx context.Context, side *pgx.Conn, lost pgx.TraceQueryStartData) error

	mu    sync.Mutex
	fired bool
	errs  []error // of the statements that failed
}

func (k *terminator) TraceQueryStart(ctx context.Context, conn *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	k.fire(ctx, conn, data)
	return ctx
}

func (k *terminator) TraceQueryEnd(_ context.Context, _ *pgx.Conn, data pgx.TraceQueryEndData) {
	k.failed(data.Err)
}

// TraceBatchStart fires on a batch that holds the statement (AsyncClaims).
func (k *terminator) TraceBatchStart(ctx context.Context, conn *pgx.Conn, data pgx.TraceBatchStartData) context.Context {
	for _, q := range data.Batch.QueuedQueries {
		k.fire(ctx, conn, pgx.TraceQueryStartData{SQL: q.SQL, Args: q.Arguments})
	}
	return ctx
}

func (k *terminator) TraceBatchQuery(_ context.Context, _ *pgx.Conn, data pgx.TraceBatchQueryData) {
	k.failed(data.Err)
}

func (k *terminator) TraceBatchEnd(_ context.Context, _ *pgx.Conn, data pgx.TraceBatchEndData) {
	k.failed(data.Err)
}

func (k *terminator) fire(ctx context.Context, conn *pgx.Conn, data pgx.TraceQueryStartData) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.fired || !strings.HasPrefix(strings.TrimSpace(data.SQL), k.prefix) {
		return
	}
	k.fired = true
	side, err := pgx.Connect(ctx, k.dsn)
	if err != nil {
		k.t.Errorf("terminator: %v", err)
		return
	}
	defer side.Close(context.WithoutCancel(ctx))
	if k.meanwhile != nil {
		if err := k.meanwhile(ctx, side, data); err != nil {
			k.t.Errorf("terminator: meanwhile: %v", err)
		}
	}
	// With a timeout, pg_terminate_backend waits until the backend is gone.
	var ended bool
	if err := side.QueryRow(ctx, `SELECT pg_terminate_backend($1, 30000)`, conn.PgConn().PID()).Scan(&ended); err != nil || !ended {
		k.t.Errorf("terminator: pg_terminate_backend = %v, %v", ended, err)
	}
}

func (k *terminator) failed(err error) {
	if err != nil {
		k.mu.Lock()
		defer k.mu.Unlock()
		k.errs = append(k.errs, err)
	}
}

// check fails the test unless the terminator fired and the statement it
// aimed at failed with admin_shutdown (a batch reports it more than once).
func (k *terminator) check(t *testing.T) {
	t.Helper()
	k.mu.Lock()
	defer k.mu.Unlock()
	if !k.fired {
		t.Fatalf("no statement starting with %q ran", k.prefix)
	}
	var pgErr *pgconn.PgError
	if len(k.errs) == 0 || !errors.As(k.errs[0], &pgErr) || pgErr.Code != "57P01" {
		t.Errorf("failed statements %v, want admin_shutdown (57P01)", k.errs)
	}
}

// rerun runs the lost statement on the side connection: it committed, and
// only its answer was lost.
func rerun(ctx context.Context, side *pgx.Conn, lost pgx.TraceQueryStartData) error {
	rows, err := side.Query(ctx, lost.SQL, lost.Args...)
	if err != nil {
		return err
	}
	rows.Close()
	return rows.Err()
}

// terminatedStore returns a store on a fresh schema whose pool runs k.
func terminatedStore(t *testing.T, k *terminator) (*server.PostgresStore, *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	k.t, k.dsn = t, pgtest.SchemaURL(t)
	cfg, err := pgxpool.ParseConfig(k.dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 2
	cfg.ConnConfig.Tracer = k
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if err := server.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	return server.NewPostgresStore(pool), pool
}

var lostReq = server.ClaimRequest{ClientID: "cli_a", Key: "key-lost", Method: "POST", Path: "/v1/payments",
	Fingerprint: []byte("fp"), FingerprintVersion: 1, LockTimeout: time.Minute}

// TestPostgresClaimConnLost ends the connection under a claim: lost before
// its commit, the retry claims the key; committed with its answer lost, the
// retry finds the key started, and the key still has one owner.
func TestPostgresClaimConnLost(t *testing.T) {
	ctx := context.Background()
	for _, async := range []bool{false, true} {
		for _, tt := range []struct {
			name      string
			meanwhile func(context.Context, *pgx.Conn, pgx.TraceQueryStartData) error
			want      server.Outcome
		}{
			{"before the commit", nil, server.Claimed},
			{"answer lost", rerun, server.Exists},
		} {
			t.Run(map[bool]string{false: "sync", true: "async"}[async]+"/"+tt.name, func(t *testing.T) {
				k := &terminator{prefix: "WITH existing", meanwhile: tt.meanwhile}
				s, _ := terminatedStore(t, k)
				s.AsyncClaims = async
				res, err := s.Claim(ctx, lostReq)
				k.check(t)
				if err != nil || res.Outcome != tt.want {
					t.Fatalf("Claim = %+v, %v; want outcome %v", res, err, tt.want)
				}
				if tt.want == server.Exists {
					// Started by the lost claim: no second owner.
					if res.Record.Status != server.StatusStarted {
						t.Errorf("record status %s, want started", res.Record.Status)
					}
					return
				}
				mustComplete(t, s, res.Claim)
			})
		}
	}
}

// mustComplete completes c with one payment, and checks it was stored.
func mustComplete(t *testing.T, s *server.PostgresStore, c server.Claim) server.Payment {
	t.Helper()
	ctx := context.Background()
	tx, err := s.Begin(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	p := server.Payment{ID: "pay_lost", ClientID: c.ClientID, Customer: "cus_1", Amount: 4200, Currency: "usd",
		IdempotencyKey: c.Key, OperationID: c.OperationID, ChargeID: "ch_lost"}
	if err := s.CreatePayment(ctx, tx, p); err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(ctx, server.StoredResponse{Status: 201, ContentType: "application/json", Body: []byte(`{"id":"pay_lost"}`)}); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	if _, err := s.GetPayment(ctx, c.ClientID, p.ID); err != nil {
		t.Errorf("GetPayment after Complete: %v", err)
	}
	return p
}

// TestPostgresCompleteConnLost ends the connection under a completion.
// Whether the lost statement committed is unknown to the store, and each
// case must come out right: not committed, the retry completes; committed
// with its answer lost, the completion succeeds (a fence here would tell
// the client that a stored payment was rolled back); taken over meanwhile,
// it is fenced and stores nothing.
func TestPostgresCompleteConnLost(t *testing.T) {
	ctx := context.Background()
	takeOver := func(ctx context.Context, side *pgx.Conn, _ pgx.TraceQueryStartData) error {
		_, err := side.Exec(ctx, `UPDATE idempotency_keys SET lock_token = nextval('idempotency_lock_tokens'), locked_at = now()
			WHERE client_id = $1 AND idempotency_key = $2`, lostReq.ClientID, lostReq.Key)
		return err
	}
	for _, tt := range []struct {
		name       string
		meanwhile  func(context.Context, *pgx.Conn, pgx.TraceQueryStartData) error
		wantFenced bool
	}{
		{"before the commit", nil, false},
		{"answer lost", rerun, false},
		{"taken over meanwhile", takeOver, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			k := &terminator{prefix: "WITH done", meanwhile: tt.meanwhile}
			s, pool := terminatedStore(t, k)
			res, err := s.Claim(ctx, lostReq)
			if err != nil || res.Outcome != server.Claimed {
				t.Fatalf("Claim = %+v, %v", res, err)
			}
			c := res.Claim
			tx, err := s.Begin(ctx, c)
			if err != nil {
				t.Fatal(err)
			}
			p := server.Payment{ID: "pay_lost", ClientID: c.ClientID, Customer: "cus_1", Amount: 4200, Currency: "usd",
				IdempotencyKey: c.Key, OperationID: c.OperationID, ChargeID: "ch_lost"}
			if err := s.CreatePayment(ctx, tx, p); err != nil {
				t.Fatal(err)
			}
			err = tx.Complete(ctx, server.StoredResponse{Status: 201, ContentType: "application/json", Body: []byte(`{"id":"pay_lost"}`)})
			k.check(t)
			var status string
			var payments int
			if err := pool.QueryRow(ctx, `SELECT (SELECT status FROM idempotency_keys), (SELECT count(*) FROM payments)`).
				Scan(&status, &payments); err != nil {
				t.Fatal(err)
			}
			if tt.wantFenced {
				if !errors.Is(err, server.ErrFenced) || status != "started" || payments != 0 {
					t.Errorf("Complete = %v; key %s, %d payments; want ErrFenced, started, 0", err, status, payments)
				}
				return
			}
			if err != nil || status != "completed" || payments != 1 {
				t.Errorf("Complete = %v; key %s, %d payments; want nil, completed, 1", err, status, payments)
			}
			again, err := s.Claim(ctx, lostReq)
			if err != nil || again.Outcome != server.Exists || again.Record.Response == nil ||
				string(again.Record.Response.Body) != `{"id":"pay_lost"}` {
				t.Errorf("replay after the lost completion: %+v, %v", again, err)
			}
		})
	}
}
