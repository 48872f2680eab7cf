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
	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/keysql"
	"github.com/idemkit/idem/server/pgstore"
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

// TraceBatchStart fires on a batch that holds the statement.
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
func terminatedStore(t *testing.T, k *terminator) (*pgstore.Store, *pgxpool.Pool) {
	t.Helper()
	k.t = t
	pool := pgtest.PoolWith(t, func(cfg *pgxpool.Config) {
		cfg.MaxConns = 2
		cfg.ConnConfig.Tracer = k
	})
	k.dsn = pool.Config().ConnString()
	migrate(t, pool)
	return pgstore.New(pool), pool
}

var lostReq = idempotency.ClaimRequest{ClientID: "cli_a", Key: "key-lost", Method: "POST", Path: "/v1/orders",
	Fingerprint: []byte("fp"), LockTimeout: time.Minute}

// TestClaimConnLost ends the connection under a claim: lost before
// its commit, the retry claims the key; committed with its answer lost, the
// retry finds the key started, and the key still has one owner.
func TestClaimConnLost(t *testing.T) {
	ctx := context.Background()
	for _, tt := range []struct {
		name      string
		meanwhile func(context.Context, *pgx.Conn, pgx.TraceQueryStartData) error
		want      idempotency.Outcome
	}{
		{"before the commit", nil, idempotency.Claimed},
		{"answer lost", rerun, idempotency.Exists},
	} {
		t.Run(tt.name, func(t *testing.T) {
			k := &terminator{prefix: "INSERT INTO idempotency_keys", meanwhile: tt.meanwhile}
			s, pool := terminatedStore(t, k)
			res, err := s.Claim(ctx, lostReq)
			k.check(t)
			if err != nil || res.Outcome != tt.want {
				t.Fatalf("Claim = %+v, %v; want outcome %v", res, err, tt.want)
			}
			if tt.want == idempotency.Exists {
				// Started by the lost claim: no second owner.
				if res.Record.Status != idempotency.StatusStarted {
					t.Errorf("record status %s, want started", res.Record.Status)
				}
				return
			}
			mustComplete(t, s, res.Claim, "w_lost")
			mustBeWritten(t, pool, "w_lost", true)
		})
	}
}

// TestClaimInTxConnLost ends the connection under a claim in one
// transaction: nothing of it was committed, and the retry, on another
// connection, claims the key in one transaction.
func TestClaimInTxConnLost(t *testing.T) {
	ctx := context.Background()
	k := &terminator{prefix: strings.TrimSpace(keysql.ClaimTxSQL)}
	s, pool := terminatedStore(t, k)
	res, err := s.ClaimInTx(ctx, lostReq)
	k.check(t)
	if err != nil || res.Outcome != idempotency.Claimed || !res.Claim.OneTransaction {
		t.Fatalf("Claim = %+v, %v; want Claimed in one transaction", res, err)
	}
	mustComplete(t, s, res.Claim, "w_lost")
	mustBeWritten(t, pool, "w_lost", true)
}

// completePrefix starts the completion of a key whose handler wrote
// nothing: an UPDATE alone (completeSQL); with writes it is "WITH done"
// (completeInTxSQL), pipelined with the COMMIT.
const completePrefix = "UPDATE idempotency_keys SET\n    status = 'completed'"

// takeOver plays, on the side connection, a takeover of lostReq's key.
func takeOver(ctx context.Context, side *pgx.Conn, _ pgx.TraceQueryStartData) error {
	_, err := side.Exec(ctx, `UPDATE idempotency_keys SET lock_token = nextval('idempotency_lock_tokens'), locked_at = now()
		WHERE client_id = $1 AND idempotency_key = $2`, lostReq.ClientID, lostReq.Key)
	return err
}

// lostState returns the status of lostReq's key, whether its token is
// still c's, and whether the handler's row w_lost is committed.
func lostState(t *testing.T, pool *pgxpool.Pool, c idempotency.Claim) (status string, ours, row bool) {
	t.Helper()
	key, _ := readKey(t, pool, lostReq.Key)
	row, err := written(context.Background(), pool, "w_lost")
	if err != nil {
		t.Fatal(err)
	}
	return key.status, key.token == c.Token, row
}

// checkReplay checks that lostReq's key replays the response of
// completeLost.
func checkReplay(t *testing.T, s idempotency.Store) {
	t.Helper()
	again, err := s.Claim(context.Background(), lostReq)
	if err != nil || again.Outcome != idempotency.Exists || again.Record.Response == nil ||
		string(again.Record.Response.Body) != `{"id":"ord_lost"}` {
		t.Errorf("replay after the lost completion: %+v, %v", again, err)
	}
}

// completeLost completes c, with the handler's row w_lost if withRow.
func completeLost(t *testing.T, s idempotency.Store, c idempotency.Claim, withRow bool) error {
	t.Helper()
	ctx := context.Background()
	tx, hctx := unitOf(t, s, c)
	if withRow {
		if err := write(hctx, "w_lost"); err != nil {
			t.Fatal(err)
		}
	}
	err := tx.Complete(ctx, created("ord_lost"))
	if rerr := tx.Rollback(ctx); rerr != nil {
		t.Errorf("Rollback after Complete: %v", rerr)
	}
	return err
}

// TestCompleteConnLost ends the connection under a completion whose
// handler wrote nothing. Whether the lost statement committed is unknown
// to the store, and each case must come out right: not committed, the
// retry completes; committed with its answer lost, the completion succeeds
// (a fence here would tell the client that a stored outcome was rolled
// back); taken over meanwhile, it is fenced and stores nothing.
func TestCompleteConnLost(t *testing.T) {
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
			k := &terminator{prefix: completePrefix, meanwhile: tt.meanwhile}
			s, pool := terminatedStore(t, k)
			c := mustClaim(t, s, lostReq, idempotency.Claimed).Claim
			err := completeLost(t, s, c, false)
			k.check(t)
			status, ours, _ := lostState(t, pool, c)
			if tt.wantFenced {
				if !errors.Is(err, idempotency.ErrFenced) || status != "started" || ours {
					t.Errorf("Complete = %v; key %s (ours: %v); want ErrFenced, started under the taker's token", err, status, ours)
				}
				return
			}
			if err != nil || status != "completed" || !ours {
				t.Errorf("Complete = %v; key %s (ours: %v); want nil, completed under the claim's token", err, status, ours)
			}
			checkReplay(t, s)
		})
	}
}

// TestCompleteInTxConnLost ends the connection under the completion of a
// handler that wrote a row, just before the completion and its COMMIT are
// sent: the handler's transaction dies with its connection, so nothing of
// it may be committed, and Complete must not report success: it returns
// an error, and the key is released under the claim's token with no row
// (Complete releases it, so that a completion still on its way is fenced:
// TestLostBatchBeforeItRuns), which leaves the middleware's release
// nothing to do (fenced; the retry of the request runs it again). Taken
// over meanwhile, nothing is committed either, and the release is fenced.
func TestCompleteInTxConnLost(t *testing.T) {
	ctx := context.Background()
	for _, tt := range []struct {
		name      string
		meanwhile func(context.Context, *pgx.Conn, pgx.TraceQueryStartData) error
		takenOver bool
	}{
		{"before the commit", nil, false},
		{"taken over meanwhile", takeOver, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			k := &terminator{prefix: "WITH done", meanwhile: tt.meanwhile}
			s, pool := terminatedStore(t, k)
			c := mustClaim(t, s, lostReq, idempotency.Claimed).Claim
			err := completeLost(t, s, c, true)
			k.check(t)
			status, ours, row := lostState(t, pool, c)
			want := "released"
			if tt.takenOver {
				want = "started"
			}
			if err == nil || status != want || row || ours == tt.takenOver {
				t.Errorf("Complete = %v; key %s (ours: %v), row committed: %v; want an error, %s (ours: %v), no row",
					err, status, ours, row, want, !tt.takenOver)
			}
			// Released by Complete: the claim's Release finds it so (nil);
			// taken over: fenced.
			var wantErr error
			if tt.takenOver {
				wantErr = idempotency.ErrFenced
			}
			if rerr := s.Release(ctx, c, idempotency.ReleaseFailed); !errors.Is(rerr, wantErr) {
				t.Errorf("Release after the lost completion: %v, want %v", rerr, wantErr)
			}
			if !tt.takenOver {
				again := mustClaim(t, s, lostReq, idempotency.Claimed).Claim
				if again.OperationID != c.OperationID {
					t.Errorf("retry under operation %s, want %s", again.OperationID, c.OperationID)
				}
			}
		})
	}
}

// TestRenewConnLost ends the connection under a renewal: lost before its
// commit or after, the renewal succeeds (a renewal done twice is one) and
// the lease is renewed; taken over meanwhile, it is fenced.
func TestRenewConnLost(t *testing.T) {
	ctx := context.Background()
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
			k := &terminator{prefix: "UPDATE idempotency_keys SET locked_at", meanwhile: tt.meanwhile}
			s, pool := terminatedStore(t, k)
			c := mustClaim(t, s, lostReq, idempotency.Claimed).Claim
			before, _ := readKey(t, pool, lostReq.Key)
			err := s.Renew(ctx, c)
			k.check(t)
			after, _ := readKey(t, pool, lostReq.Key)
			if tt.wantFenced {
				if !errors.Is(err, idempotency.ErrFenced) {
					t.Errorf("Renew = %v, want ErrFenced", err)
				}
				return
			}
			if err != nil || after.token != c.Token || !after.lockedAt.After(before.lockedAt) {
				t.Errorf("Renew = %v; key %+v; want nil, renewed under token %d after %v", err, after, c.Token, before.lockedAt)
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
	store *pgstore.Store
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
	migrate(t, w.pool)
	w.store = pgstore.New(w.pool)
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

// TestClaimConnCut breaks the connection under a claim, with no
// word from PostgreSQL: a reset or a plain close, as a network failure, a
// killed server process or a dead proxy leaves it. Cut before the
// statement reached PostgreSQL, the retry claims the key; cut after it
// committed, with its answer lost, the retry finds the key started, and the
// key still has one owner.
func TestClaimConnCut(t *testing.T) {
	ctx := context.Background()
	for _, tt := range []struct {
		name string
		kind faultproxy.Kind
		want idempotency.Outcome
	}{
		{"before the server", faultproxy.Reset, idempotency.Claimed},
		{"answer lost", faultproxy.Drop, idempotency.Exists},
	} {
		for _, cut := range cuts {
			t.Run(tt.name+"/"+cut.name, func(t *testing.T) {
				w := proxiedStore(t)
				sprung := w.arm(t, tt.kind, cut.fin)
				res, err := w.store.Claim(ctx, lostReq)
				sprung()
				w.rec.checkCut(t)
				if err != nil || res.Outcome != tt.want {
					t.Fatalf("Claim = %+v, %v; want outcome %v", res, err, tt.want)
				}
				if tt.want == idempotency.Exists {
					if res.Record.Status != idempotency.StatusStarted {
						t.Errorf("record status %s, want started", res.Record.Status)
					}
					return
				}
				mustComplete(t, w.store, res.Claim, "w_lost")
				mustBeWritten(t, w.pool, "w_lost", true)
			})
		}
	}
}

// TestClaimIdleConnsCut cuts every connection of the pool while it
// is idle. Reset, the claim's statement fails as it is written, before
// anything was sent (pgconn.SafeToRetry); closed, the write succeeds and
// the answer is an EOF. Either way the retry finds a connection that
// answers.
func TestClaimIdleConnsCut(t *testing.T) {
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
			if err != nil || res.Outcome != idempotency.Claimed {
				t.Fatalf("Claim = %+v, %v; want outcome claimed", res, err)
			}
			mustComplete(t, w.store, res.Claim, "w_lost")
			mustBeWritten(t, w.pool, "w_lost", true)
		})
	}
}

// TestCompleteConnCut breaks the connection under a completion whose
// handler wrote nothing, with no word from PostgreSQL. Cut before the
// statement reached PostgreSQL, the retry completes; cut after it
// committed, with its answer lost, the completion succeeds (a fence here
// would tell the client that a stored outcome was rolled back).
func TestCompleteConnCut(t *testing.T) {
	eachCutOfClaimed(t, func(t *testing.T, w *proxied, res idempotency.ClaimResult, kind faultproxy.Kind, fin bool) {
		sprung := w.arm(t, kind, fin)
		err := completeLost(t, w.store, res.Claim, false)
		sprung()
		w.rec.checkCut(t)
		status, ours, _ := lostState(t, w.pool, res.Claim)
		if err != nil || status != "completed" || !ours {
			t.Errorf("Complete = %v; key %s (ours: %v); want nil, completed under the claim's token", err, status, ours)
		}
		checkReplay(t, w.store)
	})
}

// TestCompleteInTxConnCut breaks the connection under the completion of a
// handler that wrote a row, pipelined with its COMMIT, with no word from
// PostgreSQL. Complete reports success if and only if the key is completed
// and the handler's row committed, together. Cut before the pipeline
// reached PostgreSQL, nothing is committed (the transaction dies with its
// connection): Complete fails, and releases the key under the claim's
// token (a completion still on its way is then fenced), which leaves the
// middleware's release nothing to do. Cut after the COMMIT was sent, with
// its answer lost, Complete learns from the key that it committed, and
// succeeds.
func TestCompleteInTxConnCut(t *testing.T) {
	ctx := context.Background()
	eachCutOfClaimed(t, func(t *testing.T, w *proxied, res idempotency.ClaimResult, kind faultproxy.Kind, fin bool) {
		c := res.Claim
		tx, hctx := unitOf(t, w.store, c)
		if err := write(hctx, "w_lost"); err != nil {
			t.Fatal(err)
		}
		sprung := w.arm(t, kind, fin)
		err := tx.Complete(ctx, created("ord_lost"))
		sprung()
		w.rec.checkCut(t)
		status, ours, row := lostState(t, w.pool, c)
		committed := status == "completed" && ours && row
		if (err == nil) != committed {
			t.Fatalf("Complete = %v, but key %s (ours: %v) and row committed: %v", err, status, ours, row)
		}
		if committed != (kind == faultproxy.Drop) {
			t.Errorf("committed: %v, want %v (cut %v)", committed, kind == faultproxy.Drop, kind)
		}
		if committed {
			checkReplay(t, w.store)
			return
		}
		if status != "released" || !ours || row {
			t.Errorf("after the failed completion: key %s (ours: %v), row %v; want released, ours, no row", status, ours, row)
		}
		if err := w.store.Release(ctx, c, idempotency.ReleaseFailed); err != nil {
			t.Errorf("Release after the failed completion: %v, want nil (Complete released the key under this claim)", err)
		}
		again := mustClaim(t, w.store, lostReq, idempotency.Claimed).Claim
		if again.OperationID != c.OperationID {
			t.Errorf("retry under operation %s, want %s", again.OperationID, c.OperationID)
		}
		mustComplete(t, w.store, again, "w_lost")
		mustBeWritten(t, w.pool, "w_lost", true)
	})
}

// TestRenewConnCut breaks the connection under a renewal, with no word
// from PostgreSQL: before the statement reached PostgreSQL or after it
// committed, the retry renews, and Renew succeeds.
func TestRenewConnCut(t *testing.T) {
	ctx := context.Background()
	eachCutOfClaimed(t, func(t *testing.T, w *proxied, res idempotency.ClaimResult, kind faultproxy.Kind, fin bool) {
		elapse(t, w.pool, lostReq.Key, time.Second) // claimed a second ago
		before, _ := readKey(t, w.pool, lostReq.Key)
		sprung := w.arm(t, kind, fin)
		err := w.store.Renew(ctx, res.Claim)
		sprung()
		w.rec.checkCut(t)
		after, _ := readKey(t, w.pool, lostReq.Key)
		if err != nil || after.status != "started" || after.token != res.Claim.Token || !after.lockedAt.After(before.lockedAt) {
			t.Errorf("Renew = %v; key %+v; want nil, renewed after %v under token %d", err, after, before.lockedAt, res.Claim.Token)
		}
	})
}

// TestContextDoneNotRetried gives up on a claim and on a completion
// while PostgreSQL makes them wait on a lock. pgx closes the connection
// under a statement whose context is done, but the caller gave up: no
// connection is acquired to run the statement again, and the context's
// error comes back.
func TestContextDoneNotRetried(t *testing.T) {
	ctx := context.Background()
	for _, op := range []struct {
		name   string
		prefix string // of the statement given up on
		run    func(ctx context.Context, w *proxied, c idempotency.Claim) error
	}{
		{"claim", "INSERT INTO idempotency_keys", func(ctx context.Context, w *proxied, _ idempotency.Claim) error {
			_, err := w.store.Claim(ctx, lostReq)
			return err
		}},
		{"complete", completePrefix, func(ctx context.Context, w *proxied, c idempotency.Claim) error {
			tx, err := w.store.Begin(ctx, c)
			if err != nil {
				return err
			}
			return tx.Complete(ctx, idempotency.StoredResponse{Status: 201, Body: []byte(`{}`)})
		}},
		{"complete in tx", "WITH done", func(ctx context.Context, w *proxied, c idempotency.Claim) error {
			tx, err := w.store.Begin(ctx, c)
			if err != nil {
				return err
			}
			if err := write(idempotency.NewContext(ctx, c, tx), "w_given_up"); err != nil {
				return err
			}
			return tx.Complete(ctx, idempotency.StoredResponse{Status: 201, Body: []byte(`{}`)})
		}},
	} {
		for _, tt := range []struct {
			name string
			want error
		}{{"cancelled", context.Canceled}, {"deadline", context.DeadlineExceeded}} {
			t.Run(op.name+"/"+tt.name, func(t *testing.T) {
				w := proxiedStore(t)
				var c idempotency.Claim
				if op.name != "claim" {
					res, err := w.store.Claim(ctx, lostReq)
					if err != nil || res.Outcome != idempotency.Claimed {
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
				mustBeWritten(t, w.pool, "w_given_up", false)
			})
		}
	}
}

// TestReleaseConnCut breaks the connection under a release, with
// no word from PostgreSQL. Cut before the statement reached PostgreSQL, the
// retry releases; cut after it committed, with its answer lost, the retry
// finds the key released under the claim's own token and the release
// succeeds. Either way the retry of the request resumes the key under the
// same operation.
func TestReleaseConnCut(t *testing.T) {
	ctx := context.Background()
	eachCutOfClaimed(t, func(t *testing.T, w *proxied, res idempotency.ClaimResult, kind faultproxy.Kind, fin bool) {
		sprung := w.arm(t, kind, fin)
		err := w.store.Release(ctx, res.Claim, idempotency.ReleaseFailed)
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
		if err != nil || again.Outcome != idempotency.Claimed || again.Claim.OperationID != res.Claim.OperationID {
			t.Errorf("retry after the lost release: %+v, %v; want claimed under operation %s", again, err, res.Claim.OperationID)
		}
		// The first claim's token no longer owns the key: releasing
		// it again is fenced, retry or not.
		if err := w.store.Release(ctx, res.Claim, idempotency.ReleaseFailed); !errors.Is(err, idempotency.ErrFenced) {
			t.Errorf("second release under the old token = %v, want ErrFenced", err)
		}
	})
}

// eachCutOfClaimed runs f as a subtest for each way to cut a connection
// with no word from PostgreSQL (before the statement reaches it, or after
// it answered; with an RST or a FIN), each on a fresh proxied store where
// lostReq has just been claimed.
func eachCutOfClaimed(t *testing.T, f func(t *testing.T, w *proxied, res idempotency.ClaimResult, kind faultproxy.Kind, fin bool)) {
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
				if err != nil || res.Outcome != idempotency.Claimed {
					t.Fatalf("Claim = %+v, %v", res, err)
				}
				f(t, w, res, tt.kind, cut.fin)
			})
		}
	}
}
