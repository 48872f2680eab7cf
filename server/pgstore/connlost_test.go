package pgstore_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/faultproxy"
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
	k.t = t
	pool := pgtest.PoolWith(t, func(cfg *pgxpool.Config) {
		cfg.MaxConns = 2
		cfg.ConnConfig.Tracer = k
	})
	k.dsn = pool.Config().ConnString()
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

// recorder is a pgx tracer that records the statements a pool starts, the
// errors they fail with, and how many connections were acquired.
type recorder struct {
	mu       sync.Mutex
	started  []string
	errs     []error
	acquires int
}

func (r *recorder) TraceAcquireStart(ctx context.Context, _ *pgxpool.Pool, _ pgxpool.TraceAcquireStartData) context.Context {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.acquires++
	return ctx
}

func (r *recorder) TraceAcquireEnd(context.Context, *pgxpool.Pool, pgxpool.TraceAcquireEndData) {}

func (r *recorder) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	r.start(data.SQL)
	return ctx
}

func (r *recorder) TraceQueryEnd(_ context.Context, _ *pgx.Conn, data pgx.TraceQueryEndData) {
	r.failed(data.Err)
}

func (r *recorder) TraceBatchStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchStartData) context.Context {
	for _, q := range data.Batch.QueuedQueries {
		r.start(q.SQL)
	}
	return ctx
}

func (r *recorder) TraceBatchQuery(_ context.Context, _ *pgx.Conn, data pgx.TraceBatchQueryData) {
	r.failed(data.Err)
}

func (r *recorder) TraceBatchEnd(_ context.Context, _ *pgx.Conn, data pgx.TraceBatchEndData) {
	r.failed(data.Err)
}

func (r *recorder) start(sql string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.started = append(r.started, strings.TrimSpace(sql))
}

func (r *recorder) failed(err error) {
	if err != nil {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.errs = append(r.errs, err)
	}
}

// runs returns how many statements starting with prefix were started,
// and how many connections were acquired.
func (r *recorder) runs(prefix string) (statements, acquires int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, sql := range r.started {
		if strings.HasPrefix(sql, prefix) {
			statements++
		}
	}
	return statements, r.acquires
}

// first returns the error of the first statement that failed, or nil.
func (r *recorder) first() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.errs) == 0 {
		return nil
	}
	return r.errs[0]
}

// checkCut fails the test unless a statement failed, the first without a
// SQLSTATE, and not because of its context: the connection broke under it.
func (r *recorder) checkCut(t *testing.T) {
	t.Helper()
	err := r.first()
	var pgErr *pgconn.PgError
	if err == nil || errors.As(err, &pgErr) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("first failed statement: %v, want a broken connection (no SQLSTATE, no context error)", err)
	}
}

// proxied is a store whose pool reaches PostgreSQL through a fault proxy.
type proxied struct {
	store *server.PostgresStore
	pool  *pgxpool.Pool
	proxy *faultproxy.Proxy
	rec   *recorder
	dsn   string // of the schema, straight to PostgreSQL
}

// proxiedStore returns a store on a fresh schema, through a fault proxy
// that passes everything until told otherwise.
func proxiedStore(t *testing.T) *proxied {
	t.Helper()
	ctx := context.Background()
	w := &proxied{rec: &recorder{}, dsn: pgtest.SchemaURL(t)}
	cfg, err := pgxpool.ParseConfig(w.dsn)
	if err != nil {
		t.Fatal(err)
	}
	cc := cfg.ConnConfig
	target := net.JoinHostPort(cc.Host, strconv.Itoa(int(cc.Port)))
	if strings.HasPrefix(cc.Host, "/") { // a Unix socket directory, as pgtest's throwaway cluster's
		target = filepath.Join(cc.Host, fmt.Sprintf(".s.PGSQL.%d", cc.Port))
	}
	w.proxy, err = faultproxy.Listen("127.0.0.1:0", faultproxy.Config{Targets: []string{target}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.proxy.Close() }) // after the pool's Close, registered below
	host, port, err := net.SplitHostPort(w.proxy.Addr())
	if err != nil {
		t.Fatal(err)
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil {
		t.Fatal(err)
	}
	cc.Host, cc.Port, cc.Fallbacks = host, uint16(p), nil
	cc.Tracer = w.rec
	cfg.MaxConns = 2
	// A statement sent on a connection the proxy cut must meet the cut, not
	// have the pool's ping on acquire catch it first.
	cfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
	w.pool, err = pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.pool.Close)
	if err := server.Migrate(ctx, w.pool); err != nil {
		t.Fatal(err)
	}
	w.store = server.NewPostgresStore(w.pool)
	return w
}

// arm arms a trap of kind on the next chunk that carries the key of
// lostReq, which the claim and completion statements send as a parameter.
// The returned function waits until the trap has sprung.
func (w *proxied) arm(t *testing.T, kind faultproxy.Kind, fin bool) (sprung func()) {
	t.Helper()
	key := []byte(lostReq.Key)
	ch, err := w.proxy.Arm(faultproxy.Trap{Kind: kind, FIN: fin, Match: func(chunk []byte) bool {
		return bytes.Contains(chunk, key)
	}})
	if err != nil {
		t.Fatal(err)
	}
	return func() {
		t.Helper()
		select {
		case <-ch:
		case <-time.After(10 * time.Second):
			t.Fatal("the trap never sprang")
		}
	}
}

// cuts are the ways a trap cuts the connection.
var cuts = []struct {
	name string
	fin  bool
}{{"reset", false}, {"closed", true}}

// TestPostgresClaimConnCut breaks the connection under a claim, with no
// word from PostgreSQL: a reset or a plain close, as a network failure, a
// killed server process or a dead proxy leaves it. Cut before the
// statement reached PostgreSQL, the retry claims the key; cut after it
// committed, with its answer lost, the retry finds the key started, and the
// key still has one owner.
func TestPostgresClaimConnCut(t *testing.T) {
	ctx := context.Background()
	for _, async := range []bool{false, true} {
		for _, tt := range []struct {
			name string
			kind faultproxy.Kind
			want server.Outcome
		}{
			{"before the server", faultproxy.Reset, server.Claimed},
			{"answer lost", faultproxy.Drop, server.Exists},
		} {
			for _, cut := range cuts {
				t.Run(fmt.Sprintf("%s/%s/%s", map[bool]string{false: "sync", true: "async"}[async], tt.name, cut.name), func(t *testing.T) {
					w := proxiedStore(t)
					w.store.AsyncClaims = async
					sprung := w.arm(t, tt.kind, cut.fin)
					res, err := w.store.Claim(ctx, lostReq)
					sprung()
					w.rec.checkCut(t)
					if err != nil || res.Outcome != tt.want {
						t.Fatalf("Claim = %+v, %v; want outcome %v", res, err, tt.want)
					}
					if tt.want == server.Exists {
						if res.Record.Status != server.StatusStarted {
							t.Errorf("record status %s, want started", res.Record.Status)
						}
						return
					}
					mustComplete(t, w.store, res.Claim)
				})
			}
		}
	}
}

// TestPostgresClaimIdleConnsCut cuts every connection of the pool while it
// is idle. Reset, the claim's statement fails as it is written, before
// anything was sent (pgconn.SafeToRetry); closed, the write succeeds and
// the answer is an EOF. Either way the retry finds a connection that
// answers.
func TestPostgresClaimIdleConnsCut(t *testing.T) {
	ctx := context.Background()
	for _, cut := range cuts {
		t.Run(cut.name, func(t *testing.T) {
			w := proxiedStore(t)
			if n := w.proxy.Cut(cut.fin); n == 0 {
				t.Fatal("the pool had no connection open to cut")
			}
			res, err := w.store.Claim(ctx, lostReq)
			w.rec.checkCut(t)
			if err := w.rec.first(); !cut.fin && !pgconn.SafeToRetry(err) {
				t.Errorf("first failed statement: %v, want a failed write", err)
			}
			if err != nil || res.Outcome != server.Claimed {
				t.Fatalf("Claim = %+v, %v; want outcome claimed", res, err)
			}
			mustComplete(t, w.store, res.Claim)
		})
	}
}

// TestPostgresCompleteConnCut breaks the connection under a completion,
// with no word from PostgreSQL. Cut before the statement reached
// PostgreSQL, the retry completes; cut after it committed, with its answer
// lost, the completion succeeds (a fence here would tell the client that a
// stored payment was rolled back).
func TestPostgresCompleteConnCut(t *testing.T) {
	ctx := context.Background()
	eachCutOfClaimed(t, func(t *testing.T, w *proxied, res server.ClaimResult, kind faultproxy.Kind, fin bool) {
		c := res.Claim
		tx, err := w.store.Begin(ctx, c)
		if err != nil {
			t.Fatal(err)
		}
		p := server.Payment{ID: "pay_lost", ClientID: c.ClientID, Customer: "cus_1", Amount: 4200, Currency: "usd",
			IdempotencyKey: c.Key, OperationID: c.OperationID, ChargeID: "ch_lost"}
		if err := w.store.CreatePayment(ctx, tx, p); err != nil {
			t.Fatal(err)
		}
		sprung := w.arm(t, kind, fin)
		err = tx.Complete(ctx, server.StoredResponse{Status: 201, ContentType: "application/json", Body: []byte(`{"id":"pay_lost"}`)})
		sprung()
		w.rec.checkCut(t)
		var status string
		var payments int
		if err := w.pool.QueryRow(ctx, `SELECT (SELECT status FROM idempotency_keys), (SELECT count(*) FROM payments)`).
			Scan(&status, &payments); err != nil {
			t.Fatal(err)
		}
		if err != nil || status != "completed" || payments != 1 {
			t.Errorf("Complete = %v; key %s, %d payments; want nil, completed, 1", err, status, payments)
		}
		again, err := w.store.Claim(ctx, lostReq)
		if err != nil || again.Outcome != server.Exists || again.Record.Response == nil ||
			string(again.Record.Response.Body) != `{"id":"pay_lost"}` {
			t.Errorf("replay after the lost completion: %+v, %v", again, err)
		}
	})
}

// TestPostgresContextDoneNotRetried gives up on a claim and on a completion
// while PostgreSQL makes them wait on a lock. pgx closes the connection
// under a statement whose context is done, but the caller gave up: no
// connection is acquired to run the statement again, and the context's
// error comes back.
func TestPostgresContextDoneNotRetried(t *testing.T) {
	ctx := context.Background()
	for _, op := range []struct {
		name   string
		prefix string // of the statement given up on
		run    func(ctx context.Context, w *proxied, c server.Claim) error
	}{
		{"claim", "WITH existing", func(ctx context.Context, w *proxied, _ server.Claim) error {
			_, err := w.store.Claim(ctx, lostReq)
			return err
		}},
		{"complete", "WITH done", func(ctx context.Context, w *proxied, c server.Claim) error {
			tx, err := w.store.Begin(ctx, c)
			if err != nil {
				return err
			}
			return tx.Complete(ctx, server.StoredResponse{Status: 201, Body: []byte(`{}`)})
		}},
	} {
		for _, tt := range []struct {
			name string
			want error
		}{{"cancelled", context.Canceled}, {"deadline", context.DeadlineExceeded}} {
			t.Run(op.name+"/"+tt.name, func(t *testing.T) {
				w := proxiedStore(t)
				var c server.Claim
				if op.name == "complete" {
					res, err := w.store.Claim(ctx, lostReq)
					if err != nil || res.Outcome != server.Claimed {
						t.Fatalf("Claim = %+v, %v", res, err)
					}
					c = res.Claim
				}
				side, err := pgx.Connect(ctx, w.dsn)
				if err != nil {
					t.Fatal(err)
				}
				defer side.Close(ctx)
				lock, err := side.Begin(ctx)
				if err != nil {
					t.Fatal(err)
				}
				defer lock.Rollback(ctx)
				if _, err := lock.Exec(ctx, `LOCK TABLE idempotency_keys`); err != nil {
					t.Fatal(err)
				}
				opCtx, cancel := context.WithTimeout(ctx, time.Second)
				if tt.want == context.Canceled {
					watch, err := pgx.Connect(ctx, w.dsn)
					if err != nil {
						t.Fatal(err)
					}
					defer watch.Close(ctx)
					opCtx, cancel = context.WithCancel(ctx)
					go func() {
						// Give up once the statement waits on the lock.
						for {
							var waiting bool
							err := watch.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks
								WHERE NOT granted AND relation = 'idempotency_keys'::regclass)`).Scan(&waiting)
							if err != nil || waiting {
								break
							}
							time.Sleep(5 * time.Millisecond)
						}
						cancel()
					}()
				}
				defer cancel()
				statements, acquires := w.rec.runs(op.prefix)
				err = op.run(opCtx, w, c)
				if !errors.Is(err, tt.want) {
					t.Errorf("%s = %v, want %v", op.name, err, tt.want)
				}
				statementsAfter, acquiresAfter := w.rec.runs(op.prefix)
				if got := statementsAfter - statements; got != 1 {
					t.Errorf("the statement ran %d times, want once", got)
				}
				if got := acquiresAfter - acquires; got != 1 {
					t.Errorf("%d connections acquired, want 1: none for a retry", got)
				}
			})
		}
	}
}

// TestPostgresReleaseConnCut breaks the connection under a release, with
// no word from PostgreSQL. Cut before the statement reached PostgreSQL, the
// retry releases; cut after it committed, with its answer lost, the retry
// finds the key released under the claim's own token and the release
// succeeds. Either way the retry of the request resumes the key under the
// same operation.
func TestPostgresReleaseConnCut(t *testing.T) {
	ctx := context.Background()
	eachCutOfClaimed(t, func(t *testing.T, w *proxied, res server.ClaimResult, kind faultproxy.Kind, fin bool) {
		sprung := w.arm(t, kind, fin)
		err := w.store.Release(ctx, res.Claim, server.ReleaseFailed)
		sprung()
		w.rec.checkCut(t)
		if err != nil {
			t.Fatalf("Release = %v, want nil", err)
		}
		var status string
		if err := w.pool.QueryRow(ctx, `SELECT status FROM idempotency_keys`).Scan(&status); err != nil || status != "released" {
			t.Fatalf("key status %q, %v; want released", status, err)
		}
		again, err := w.store.Claim(ctx, lostReq)
		if err != nil || again.Outcome != server.Claimed || again.Claim.OperationID != res.Claim.OperationID {
			t.Errorf("retry after the lost release: %+v, %v; want claimed under operation %s", again, err, res.Claim.OperationID)
		}
		// The first claim's token no longer owns the key: releasing
		// it again is fenced, retry or not.
		if err := w.store.Release(ctx, res.Claim, server.ReleaseFailed); !errors.Is(err, server.ErrFenced) {
			t.Errorf("second release under the old token = %v, want ErrFenced", err)
		}
	})
}

// eachCutOfClaimed runs f as a subtest for each way to cut a connection
// with no word from PostgreSQL (before the statement reaches it, or after
// it answered; with an RST or a FIN), each on a fresh proxied store where
// lostReq has just been claimed.
func eachCutOfClaimed(t *testing.T, f func(t *testing.T, w *proxied, res server.ClaimResult, kind faultproxy.Kind, fin bool)) {
	for _, tt := range []struct {
		name string
		kind faultproxy.Kind
	}{
		{"before the server", faultproxy.Reset},
		{"answer lost", faultproxy.Drop},
	} {
		for _, cut := range cuts {
			t.Run(tt.name+"/"+cut.name, func(t *testing.T) {
				w := proxiedStore(t)
				res, err := w.store.Claim(context.Background(), lostReq)
				if err != nil || res.Outcome != server.Claimed {
					t.Fatalf("Claim = %+v, %v", res, err)
				}
				f(t, w, res, tt.kind, cut.fin)
			})
		}
	}
}
