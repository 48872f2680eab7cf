// Command benchserver serves one handler three ways, on one pool and one
// database, for the load test's comparison of idem with what a user would
// write instead (cd bench && go run ./cmd/loadtest -handler orders ...
// builds and starts it):
//
//	POST /idem/v1/{payments,orders}     the handler behind idempotency.Middleware on pgstore
//	POST /article/v1/{payments,orders}  the seed article's Steps 2 and 3 by hand (article.go)
//	POST /unkeyed/v1/{payments,orders}  the handler alone, in BEGIN, its INSERT, COMMIT
//	GET  /healthz
//
// -handler orders writes one order row, and nothing else: a handler for
// idem's one-transaction mode (-one-transaction). -handler payments first
// calls a card processor (a fake on another loopback port of this process,
// keyed by the operation) and then writes the payment row: a handler that
// keeps the claim committed on its own. The three ways share the handler's
// code, the pool (-db-max-conns) and the client's authentication (Bearer
// sk_test_demo).
//
// idem's key table has no open keys' index by default, as a service without
// a sweeper has none and the article has no sweeper: its key completions
// can be HOT updates, as the article's are. An index left on the table (by
// a run with -open-index, or by an earlier release's Migrate) is dropped at
// start. -open-index creates it instead (pgstore.CreateOpenKeysIndex), to
// measure what it costs a service that runs a sweeper or key gauges.
//
// Usage:
//
//	benchserver -addr 127.0.0.1:8080 -database-url URL -handler orders [-one-transaction] [-reset] [-open-index]
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stderr); err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "benchserver:", err)
		os.Exit(1)
	}
}

// config holds the flags.
type config struct {
	addr, databaseURL, handler string
	oneTx, reset, openIndex    bool
	maxConns                   int
	drive                      string // a way to drive in process (drive.go), or "" to serve
	requests                   int
}

func parseFlags(args []string, stderr io.Writer) (config, error) {
	var c config
	fs := flag.NewFlagSet("benchserver", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.addr, "addr", "127.0.0.1:8080", "loopback `address` to listen on")
	fs.StringVar(&c.databaseURL, "database-url", "", "PostgreSQL `DSN` (required)")
	fs.StringVar(&c.handler, "handler", "orders", "the handler: orders or payments")
	fs.BoolVar(&c.oneTx, "one-transaction", false, "idem's route in one-transaction mode (idempotency.Options.OneTransaction)")
	fs.BoolVar(&c.reset, "reset", false, "empty the key tables and the handler's tables at start")
	fs.IntVar(&c.maxConns, "db-max-conns", 16, "the pool's size, shared by the three ways")
	fs.BoolVar(&c.openIndex, "open-index", false,
		"create idempotency_keys_open_idx after the migration (a measurement: the index a sweeper and key gauges need, which keeps a key's updates from being HOT); without it, one left on the table is dropped")
	fs.StringVar(&c.drive, "drive", "",
		"serve -requests requests of one `way` (first, article, unkeyed, replay, read) in this process, print this process's backend PID, and exit: bench/backend-instructions.sh")
	fs.IntVar(&c.requests, "requests", 500, "with -drive: the requests")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	switch {
	case fs.NArg() > 0:
		return c, fmt.Errorf("unexpected arguments %q", fs.Args())
	case c.databaseURL == "":
		return c, errors.New("-database-url is required")
	case c.handler != "orders" && c.handler != "payments":
		return c, fmt.Errorf("-handler %q: want orders or payments", c.handler)
	case c.maxConns < 1:
		return c, errors.New("-db-max-conns must be positive")
	}
	if err := loopbackAddr(c.addr); err != nil {
		return c, err
	}
	return c, nil
}

// loopbackAddr refuses a listen address that is not on loopback.
func loopbackAddr(addr string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("-addr %q: %w", addr, err)
	}
	if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		return fmt.Errorf("-addr %q: loopback only", addr)
	}
	return nil
}

func run(ctx context.Context, args []string, stderr io.Writer) error {
	c, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	cfg, err := pgxpool.ParseConfig(c.databaseURL)
	if err != nil {
		return err
	}
	cfg.MaxConns = int32(c.maxConns)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := migrate(ctx, pool, c.reset, c.openIndex); err != nil {
		return err
	}
	if c.drive != "" {
		var pid int
		if err := pool.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
			return err
		}
		fmt.Fprintln(stderr, "backend", pid) // the pool's only connection, with -db-max-conns 1
		h := &handler{name: c.handler}
		return drive(routes(pool, h, c.oneTx, slog.New(slog.DiscardHandler)), h, c.drive, c.requests)
	}
	ln, err := net.Listen("tcp", c.addr)
	if err != nil {
		return err
	}
	h := &handler{name: c.handler}
	if c.handler == "payments" {
		proc, err := startProcessor()
		if err != nil {
			return err
		}
		defer proc.Close()
		h.processor = proc.URL
		h.client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4 * c.maxConns}, Timeout: 10 * time.Second}
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	srv := &http.Server{Handler: routes(pool, h, c.oneTx, log), ReadTimeout: 30 * time.Second}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// routes serves h the three ways on pool.
func routes(pool *pgxpool.Pool, h *handler, oneTx bool, log *slog.Logger) http.Handler {
	keyed := idempotency.Middleware(pgstore.New(pool), idempotency.Options{
		ClientID:       authenticate,
		OneTransaction: oneTx,
		Logger:         log,
	})
	path := "/v1/" + h.name
	mux := http.NewServeMux()
	mux.Handle("POST /idem"+path, keyed(http.HandlerFunc(h.idem)))
	mux.Handle("POST /article"+path, &article{pool: pool, h: h})
	mux.Handle("POST /unkeyed"+path, &unkeyed{pool: pool, h: h})
	mux.HandleFunc("GET /read"+path+"/{id}", h.read(pool))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok\n") })
	return mux
}

// authenticate is the service's own authentication, the same for the
// three ways: one client, by its bearer token.
func authenticate(r *http.Request) (string, bool) {
	return "cli_demo", r.Header.Get("Authorization") == "Bearer sk_test_demo"
}

// migrate creates idem's key table, the article's and the handlers', and
// creates idem's open keys' index if openIndex, or else drops one left
// on the table, so that the table is what the flag says.
func migrate(ctx context.Context, pool *pgxpool.Pool, reset, openIndex bool) error {
	if err := pgstore.Migrate(ctx, pool); err != nil {
		return err
	}
	if openIndex {
		if err := pgstore.CreateOpenKeysIndex(ctx, pool); err != nil {
			return err
		}
	} else if _, err := pool.Exec(ctx, `DROP INDEX CONCURRENTLY IF EXISTS idempotency_keys_open_idx`); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, articleSchema+handlerSchema); err != nil {
		return err
	}
	if reset {
		_, err := pool.Exec(ctx, `TRUNCATE idempotency_keys, idempotency_keys_article, bench_orders, bench_payments`)
		return err
	}
	return nil
}

// handlerSchema holds the handlers' tables.
const handlerSchema = `
CREATE TABLE IF NOT EXISTS bench_orders (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    client_id text   NOT NULL,
    customer text    NOT NULL,
    amount   bigint  NOT NULL,
    currency text    NOT NULL
);
CREATE TABLE IF NOT EXISTS bench_payments (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    client_id text   NOT NULL,
    customer  text   NOT NULL,
    amount    bigint NOT NULL,
    currency  text   NOT NULL,
    charge_id text   NOT NULL
);`

// request is the body of a POST, the load test's paymentBody.
type request struct {
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
	Customer string `json:"customer"`
	charge   string // the processor's charge, payments only
}

func parseRequest(body []byte) (request, error) {
	var in request
	if err := json.Unmarshal(body, &in); err != nil {
		return in, fmt.Errorf("invalid JSON: %v", err)
	}
	if in.Amount <= 0 || in.Currency == "" || in.Customer == "" {
		return in, errors.New("amount, currency and customer are required")
	}
	return in, nil
}

// handler is the business logic the three ways share.
type handler struct {
	name      string       // orders or payments
	processor string       // the fake processor's URL (payments)
	client    *http.Client // to the processor (payments)
}

// querier is what write needs of a transaction.
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// call makes the downstream call of a payment, keyed by ref, and keeps its
// charge in in; orders call nothing.
func (h *handler) call(ctx context.Context, ref string, in *request) error {
	if h.processor == "" {
		return nil
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, h.processor+"/charges",
		strings.NewReader(`{"amount":`+strconv.FormatInt(in.Amount, 10)+`}`))
	if err != nil {
		return err
	}
	req.Header.Set("Idempotency-Key", ref)
	resp, err := h.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var ch struct{ ID string }
	if err := json.NewDecoder(resp.Body).Decode(&ch); err != nil || resp.StatusCode != http.StatusOK || ch.ID == "" {
		return fmt.Errorf("processor: status %d: %v", resp.StatusCode, err)
	}
	in.charge = ch.ID
	return nil
}

// write inserts the row of in and returns the 201's body.
func (h *handler) write(ctx context.Context, q querier, client string, in request) ([]byte, error) {
	var id int64
	var err error
	if h.name == "payments" {
		err = q.QueryRow(ctx, `INSERT INTO bench_payments (client_id, customer, amount, currency, charge_id)
			VALUES ($1, $2, $3, $4, $5) RETURNING id`, client, in.Customer, in.Amount, in.Currency, in.charge).Scan(&id)
	} else {
		err = q.QueryRow(ctx, `INSERT INTO bench_orders (client_id, customer, amount, currency)
			VALUES ($1, $2, $3, $4) RETURNING id`, client, in.Customer, in.Amount, in.Currency).Scan(&id)
	}
	if err != nil {
		return nil, err
	}
	return json.Marshal(struct {
		ID       int64  `json:"id"`
		Amount   int64  `json:"amount"`
		Currency string `json:"currency"`
		Customer string `json:"customer"`
		Charge   string `json:"charge,omitempty"`
	}{id, in.Amount, in.Currency, in.Customer, in.charge})
}

// read returns the handler of GET /read/v1/{orders,payments}/{id}: the
// stored row by primary key, unkeyed, as a JSON body. It is the load
// test's yardstick for a replay, which is one indexed read too.
func (h *handler) read(pool *pgxpool.Pool) http.HandlerFunc {
	query := `SELECT id, amount, currency, customer, '' FROM bench_orders WHERE id = $1 AND client_id = $2`
	if h.name == "payments" {
		query = `SELECT id, amount, currency, customer, charge_id FROM bench_payments WHERE id = $1 AND client_id = $2`
	}
	return func(w http.ResponseWriter, r *http.Request) {
		client, ok := authenticate(r)
		if !ok {
			http.Error(w, "unauthorized", http.StatusUnauthorized)
			return
		}
		id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
		if err != nil {
			http.Error(w, "id", http.StatusBadRequest)
			return
		}
		var out struct {
			ID       int64  `json:"id"`
			Amount   int64  `json:"amount"`
			Currency string `json:"currency"`
			Customer string `json:"customer"`
			Charge   string `json:"charge,omitempty"`
		}
		err = pool.QueryRow(r.Context(), query, id, client).Scan(&out.ID, &out.Amount, &out.Currency, &out.Customer, &out.Charge)
		if errors.Is(err, pgx.ErrNoRows) {
			http.Error(w, "not found", http.StatusNotFound)
			return
		}
		if err != nil {
			http.Error(w, "database", http.StatusServiceUnavailable)
			return
		}
		body, _ := json.Marshal(out)
		w.Header().Set("Content-Type", "application/json")
		w.Write(body)
	}
}

// idem is the handler behind the middleware: its row is written in the
// key's transaction.
func (h *handler) idem(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, "body", http.StatusBadRequest)
		return
	}
	in, err := parseRequest(body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	claim, _ := idempotency.ClaimFromContext(ctx)
	if err := h.call(ctx, claim.OperationID, &in); err != nil {
		http.Error(w, "processor", http.StatusBadGateway)
		return
	}
	tx, err := pgstore.Tx(ctx)
	if err != nil {
		http.Error(w, "database", http.StatusServiceUnavailable)
		return
	}
	resp, err := h.write(ctx, tx, claim.ClientID, in)
	if err != nil {
		http.Error(w, "database", http.StatusInternalServerError)
		return
	}
	writeJSON(w, http.StatusCreated, resp, false)
}

// unkeyed is the handler without any idempotency: BEGIN, its INSERT,
// COMMIT.
type unkeyed struct {
	pool *pgxpool.Pool
	h    *handler
}

func (u *unkeyed) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	client, ok := authenticate(r)
	if !ok {
		http.Error(w, "unauthorized", http.StatusUnauthorized)
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 1<<20))
	if err != nil {
		http.Error(w, "body", http.StatusBadRequest)
		return
	}
	in, err := parseRequest(body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	if err := u.h.call(ctx, uuid.NewString(), &in); err != nil {
		http.Error(w, "processor", http.StatusBadGateway)
		return
	}
	var resp []byte
	err = pgx.BeginFunc(ctx, u.pool, func(tx pgx.Tx) error {
		var err error
		resp, err = u.h.write(ctx, tx, client, in)
		return err
	})
	if err != nil {
		http.Error(w, "database", http.StatusInternalServerError)
		return
	}
	writeJSON(w, http.StatusCreated, resp, false)
}

// writeJSON answers status with a JSON body.
func writeJSON(w http.ResponseWriter, status int, body []byte, replayed bool) {
	w.Header().Set("Content-Type", "application/json")
	if replayed {
		w.Header().Set("Idempotent-Replayed", "true")
	}
	w.WriteHeader(status)
	w.Write(body)
}

// processor is the fake card processor of the payments handler: it answers
// a charge at once, the same charge for the same key.
type processor struct {
	URL string
	srv *http.Server
}

func startProcessor() (*processor, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /charges", func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		key := r.Header.Get("Idempotency-Key")
		if key == "" {
			http.Error(w, "Idempotency-Key required", http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"ch_`+key+`"}`)
	})
	p := &processor{URL: "http://" + ln.Addr().String(), srv: &http.Server{Handler: mux, ReadTimeout: 10 * time.Second}}
	go p.srv.Serve(ln)
	return p, nil
}

// Close stops the processor.
func (p *processor) Close() { p.srv.Close() }
