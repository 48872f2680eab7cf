// Command sqlcost measures the CPU of a keyed first execution on sqlstore
// (database/sql, on pgx's stdlib and on lib/pq) against pgstore (pgx), on
// the same handler: the middleware, the claim, one INSERT of an order
// through the request's transaction, the completion and the commit; and,
// to tell the store's cost from the driver's, the handler alone on each
// driver (unkeyed-*: BEGIN, the INSERT, COMMIT, no middleware; unkeyed-pgx-1rt
// sends the three in one round trip, pricing a round trip). The -1tx
// stores are the same handler with idempotency.Options.OneTransaction,
// compared with pgstore-1tx.
//
//	go run ./cmd/sqlcost [-database-url URL] [-n 2000] [-c 4] [-rounds 4]
//
// Each round runs every store once, in turn, on a schema of its own (made
// and dropped here): n requests with new keys, from c goroutines calling
// the middleware's ServeHTTP (no HTTP in the way). CPU per request is the
// Go process's CPU time (getrusage) plus the CPU time of the PostgreSQL
// backends of the store's own connections (utime and stime from /proc;
// the pools hold c connections from a warm-up to the end, so the backends
// are the same over the run), divided by n: the work of the request on
// both sides, and none of the other load on a shared machine. It reads
// /proc of the PostgreSQL backends, so it runs on the machine of the
// database, as a user that can read them. It prints a line per run and,
// at the end, each store's median and range, its ratio to pgstore's, and
// the ratios to pgstore's paired by round, with their median.
package main

import (
	"context"
	"database/sql"
	"flag"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib"
	_ "github.com/lib/pq"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
	"github.com/idemkit/idem/server/sqlstore"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "sqlcost:", err)
		os.Exit(1)
	}
}

// store is one store under test on a schema's connection string: its
// handler, and the connections' pool to close.
type store struct {
	name string
	open func(ctx context.Context, url string, conns int) (h http.Handler, close func(), err error)
}

var stores = []store{
	{"pgstore", func(ctx context.Context, url string, conns int) (http.Handler, func(), error) {
		return openPgstore(ctx, url, conns, idempotency.Options{})
	}},
	{"sqlstore-pgx", func(ctx context.Context, url string, conns int) (http.Handler, func(), error) {
		return openSQLStore(ctx, "pgx", url, conns, idempotency.Options{})
	}},
	{"sqlstore-pq", func(ctx context.Context, url string, conns int) (http.Handler, func(), error) {
		return openSQLStore(ctx, "postgres", url, conns, idempotency.Options{})
	}},
	{"pgstore-1tx", func(ctx context.Context, url string, conns int) (http.Handler, func(), error) {
		return openPgstore(ctx, url, conns, idempotency.Options{OneTransaction: true})
	}},
	{"sqlstore-pgx-1tx", func(ctx context.Context, url string, conns int) (http.Handler, func(), error) {
		return openSQLStore(ctx, "pgx", url, conns, idempotency.Options{OneTransaction: true})
	}},
	{"sqlstore-pq-1tx", func(ctx context.Context, url string, conns int) (http.Handler, func(), error) {
		return openSQLStore(ctx, "postgres", url, conns, idempotency.Options{OneTransaction: true})
	}},
	{"unkeyed-pgx", openUnkeyedPgx},
	{"unkeyed-pgx-1rt", openUnkeyedPgxOneTrip},
	{"unkeyed-sql-pgx", func(ctx context.Context, url string, conns int) (http.Handler, func(), error) {
		return openUnkeyedSQL(ctx, "pgx", url, conns)
	}},
	{"unkeyed-sql-pq", func(ctx context.Context, url string, conns int) (http.Handler, func(), error) {
		return openUnkeyedSQL(ctx, "postgres", url, conns)
	}},
}

// openUnkeyedPgx is the handler alone on pgx, without the middleware:
// BEGIN, the INSERT, COMMIT, what the handler costs without a key.
func openUnkeyedPgx(ctx context.Context, url string, conns int) (http.Handler, func(), error) {
	pool, err := newPool(ctx, url, conns, nil)
	if err != nil {
		return nil, nil, err
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		err := pgx.BeginFunc(r.Context(), pool, func(tx pgx.Tx) error {
			_, err := tx.Exec(r.Context(), insertSQL, "book", 2)
			return err
		})
		if err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		created(w)
	})
	return h, pool.Close, nil
}

// openUnkeyedPgxOneTrip is openUnkeyedPgx's BEGIN, INSERT and COMMIT in
// one round trip (a batch) instead of three: against unkeyed-pgx, the
// price of two round trips, whatever the statements.
func openUnkeyedPgxOneTrip(ctx context.Context, url string, conns int) (http.Handler, func(), error) {
	pool, err := newPool(ctx, url, conns, nil)
	if err != nil {
		return nil, nil, err
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b := &pgx.Batch{}
		b.Queue("BEGIN")
		b.Queue(insertSQL, "book", 2)
		b.Queue("COMMIT")
		if err := pool.SendBatch(r.Context(), b).Close(); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		created(w)
	})
	return h, pool.Close, nil
}

// openUnkeyedSQL is the handler alone on database/sql.
func openUnkeyedSQL(ctx context.Context, driver, url string, conns int) (http.Handler, func(), error) {
	db, err := newDB(ctx, driver, url, conns, nil)
	if err != nil {
		return nil, nil, err
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, err := db.BeginTx(r.Context(), nil)
		if err == nil {
			if _, err = tx.ExecContext(r.Context(), insertSQL, "book", 2); err == nil {
				err = tx.Commit()
			} else {
				_ = tx.Rollback()
			}
		}
		if err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		created(w)
	})
	return h, func() { db.Close() }, nil
}

const ordersSQL = `CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, item text NOT NULL, qty integer NOT NULL)`

const insertSQL = `INSERT INTO orders (item, qty) VALUES ($1, $2)`

// created is the handler's answer.
func created(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	_, _ = w.Write([]byte(`{"item":"book","qty":2}`))
}

func openPgstore(ctx context.Context, url string, conns int, opts idempotency.Options) (http.Handler, func(), error) {
	pool, err := newPool(ctx, url, conns, pgstore.Migrate)
	if err != nil {
		return nil, nil, err
	}
	h := idempotency.Middleware(pgstore.New(pool), opts)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, err := pgstore.Tx(r.Context())
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		if _, err := tx.Exec(r.Context(), insertSQL, "book", 2); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		created(w)
	}))
	return h, pool.Close, nil
}

func openSQLStore(ctx context.Context, driver, url string, conns int, opts idempotency.Options) (http.Handler, func(), error) {
	db, err := newDB(ctx, driver, url, conns, sqlstore.Migrate)
	if err != nil {
		return nil, nil, err
	}
	h := idempotency.Middleware(sqlstore.New(db), opts)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, err := sqlstore.Tx(r.Context())
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		if _, err := tx.ExecContext(r.Context(), insertSQL, "book", 2); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		created(w)
	}))
	return h, func() { db.Close() }, nil
}

// newPool opens a pgx pool of conns connections on url, migrates it with
// migrate if not nil, and creates the orders table.
func newPool(ctx context.Context, url string, conns int, migrate func(context.Context, *pgxpool.Pool) error) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.MinConns, cfg.MaxConns = int32(conns), int32(conns)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if migrate != nil {
		err = migrate(ctx, pool)
	}
	if err == nil {
		_, err = pool.Exec(ctx, ordersSQL)
	}
	if err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

// newDB opens a database/sql pool of driver with conns connections on url,
// migrates it with migrate if not nil, and creates the orders table.
func newDB(ctx context.Context, driver, url string, conns int, migrate func(context.Context, *sql.DB) error) (*sql.DB, error) {
	db, err := sql.Open(driver, url)
	if err != nil {
		return nil, err
	}
	db.SetMaxOpenConns(conns)
	db.SetMaxIdleConns(conns)
	if migrate != nil {
		err = migrate(ctx, db)
	}
	if err == nil {
		_, err = db.ExecContext(ctx, ordersSQL)
	}
	if err != nil {
		db.Close()
		return nil, err
	}
	return db, nil
}

func run() error {
	dbURL := flag.String("database-url", "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable", "PostgreSQL")
	n := flag.Int("n", 2000, "requests per store and round")
	c := flag.Int("c", 4, "concurrent requests (and connections)")
	rounds := flag.Int("rounds", 4, "rounds; each runs every store once")
	only := flag.String("stores", "", "comma-separated stores to run (default: all)")
	profile := flag.String("cpuprofile", "", "write a CPU profile of the whole run to this file")
	flag.Parse()
	if *profile != "" {
		f, err := os.Create(*profile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	ctx := context.Background()
	admin, err := pgx.Connect(ctx, *dbURL)
	if err != nil {
		return err
	}
	defer admin.Close(ctx)
	var load string
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		load = strings.Join(strings.Fields(string(b))[:3], " ")
	}
	fmt.Printf("# %s, load average %s, n=%d c=%d rounds=%d\n", time.Now().UTC().Format(time.RFC3339), load, *n, *c, *rounds)
	results := map[string][]float64{}
	var names []string
	for _, s := range stores {
		if *only == "" || slices.Contains(strings.Split(*only, ","), s.name) {
			names = append(names, s.name)
		}
	}
	for r := 1; r <= *rounds; r++ {
		for _, name := range names {
			s := stores[slices.IndexFunc(stores, func(s store) bool { return s.name == name })]
			us, rate, err := measure(ctx, admin, *dbURL, s, *n, *c)
			if err != nil {
				return fmt.Errorf("%s: %w", s.name, err)
			}
			results[s.name] = append(results[s.name], us)
			fmt.Printf("%-16s round %d: %4.0f µs of CPU per request (Go %s); %.0f req/s\n", s.name, r, us, goShare, rate)
		}
	}
	for _, name := range names {
		v := results[name]
		fmt.Printf("%-16s median %4.0f µs [%s]", name, median(v), join(v))
		baseName := "pgstore"
		if strings.HasSuffix(name, "-1tx") {
			baseName = "pgstore-1tx"
		}
		if base := results[baseName]; len(base) == len(v) && name != baseName && !strings.HasPrefix(name, "unkeyed") {
			ratios := make([]float64, len(v))
			for i := range v {
				ratios[i] = v[i] / base[i]
			}
			fmt.Printf("  %.2f × %s; paired by round %s: median %.2f", median(v)/median(base), baseName, joinRatios(ratios), median(ratios))
		}
		fmt.Println()
	}
	return nil
}

// goShare is the last run's Go share of the CPU, for its line.
var goShare string

// measure runs n first executions of s on a new schema and returns the
// CPU per request in µs, and the rate.
func measure(ctx context.Context, admin *pgx.Conn, dbURL string, s store, n, c int) (float64, float64, error) {
	schema := "sqlcost_" + strings.ReplaceAll(s.name, "-", "_")
	if _, err := admin.Exec(ctx, "DROP SCHEMA IF EXISTS "+schema+" CASCADE; CREATE SCHEMA "+schema); err != nil {
		return 0, 0, err
	}
	defer admin.Exec(context.WithoutCancel(ctx), "DROP SCHEMA IF EXISTS "+schema+" CASCADE") //nolint:errcheck
	app := "sqlcost-" + s.name
	url := withParams(dbURL, "search_path", schema, "application_name", app)
	h, closeStore, err := s.open(ctx, url, c)
	if err != nil {
		return 0, 0, err
	}
	defer closeStore()
	send(h, c, 200) // warm-up: every connection open, statements prepared
	pids, err := backends(ctx, admin, app)
	if err != nil {
		return 0, 0, err
	}
	if len(pids) != c {
		return 0, 0, fmt.Errorf("%d backends after the warm-up, want %d", len(pids), c)
	}
	pg0, err := cpuTicks(pids)
	if err != nil {
		return 0, 0, err
	}
	go0 := rusage()
	start := time.Now()
	if failed := send(h, c, n); failed > 0 {
		return 0, 0, fmt.Errorf("%d requests of %d did not get 201", failed, n)
	}
	elapsed := time.Since(start)
	goCPU := rusage() - go0
	pg1, err := cpuTicks(pids)
	if err != nil {
		return 0, 0, err
	}
	if after, err := backends(ctx, admin, app); err != nil || !slices.Equal(after, pids) {
		return 0, 0, fmt.Errorf("the store's backends changed over the run (%v, then %v, %v)", pids, after, err)
	}
	pgCPU := time.Duration(pg1-pg0) * time.Second / time.Duration(clkTck)
	total := goCPU + pgCPU
	goShare = fmt.Sprintf("%.0f µs, PostgreSQL %.0f µs", float64(goCPU.Microseconds())/float64(n), float64(pgCPU.Microseconds())/float64(n))
	return float64(total.Microseconds()) / float64(n), float64(n) / elapsed.Seconds(), nil
}

// send sends n keyed POSTs to h from c goroutines and returns how many
// did not get 201.
func send(h http.Handler, c, n int) int64 {
	var next, failed atomic.Int64
	var wg sync.WaitGroup
	for range c {
		wg.Go(func() {
			for next.Add(1) <= int64(n) {
				r := httptest.NewRequestWithContext(idempotency.WithClientID(context.Background(), "shop"),
					"POST", "/orders", strings.NewReader(`{"item":"book","qty":2}`))
				r.Header.Set("Idempotency-Key", uuid.NewString())
				w := httptest.NewRecorder()
				h.ServeHTTP(w, r)
				if w.Code != http.StatusCreated {
					failed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	return failed.Load()
}

// backends returns the pids of the backends of application app, sorted.
func backends(ctx context.Context, admin *pgx.Conn, app string) ([]int, error) {
	rows, _ := admin.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE application_name = $1 ORDER BY pid`, app)
	return pgx.CollectRows(rows, pgx.RowTo[int])
}

// clkTck is the kernel's clock ticks per second of /proc's times
// (getconf CLK_TCK; 100 on Linux).
const clkTck = 100

// cpuTicks returns the CPU time (utime + stime) of pids, in clock ticks.
func cpuTicks(pids []int) (int64, error) {
	var t int64
	for _, pid := range pids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return 0, err
		}
		s := string(b)
		fields := strings.Fields(s[strings.LastIndexByte(s, ')')+2:]) // after "pid (comm) "
		for _, f := range fields[11:13] {                             // utime, stime: fields 14 and 15
			v, err := strconv.ParseInt(f, 10, 64)
			if err != nil {
				return 0, err
			}
			t += v
		}
	}
	return t, nil
}

// rusage returns the CPU time (user and system) of this process.
func rusage() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// withParams returns url with query parameters set (a URL form
// connection string).
func withParams(url string, kv ...string) string {
	sep := "?"
	if strings.Contains(url, "?") {
		sep = "&"
	}
	for i := 0; i < len(kv); i += 2 {
		url += sep + kv[i] + "=" + kv[i+1]
		sep = "&"
	}
	return url
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(v))
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func joinRatios(v []float64) string {
	parts := make([]string, len(v))
	for i, x := range v {
		parts[i] = strconv.FormatFloat(x, 'f', 2, 64)
	}
	return strings.Join(parts, " ")
}

func join(v []float64) string {
	parts := make([]string, len(v))
	for i, x := range v {
		parts[i] = strconv.FormatFloat(x, 'f', 0, 64)
	}
	return strings.Join(parts, " ")
}
