// Command outbox is an order service that does its follow-up work through
// an outbox, with River (github.com/riverqueue/river) as the queue.
//
// POST /orders runs behind the idempotency middleware on PostgreSQL
// (server/pgstore; with -store sql, server/sqlstore on database/sql). Its
// handler writes the order and enqueues a River job to ship it, both
// through the key's transaction (pgstore.Tx, or sqlstore.Tx and River's
// riverdatabasesql driver): the order, the job and the key's stored
// outcome commit in one transaction, or none of them does.
// A worker (River) runs the job: it calls the shipping API through
// idem.Transport with an Idempotency-Key derived from the claim's
// OperationID, stored in the job, and records the shipment on the order in
// the transaction that completes the job. A crash anywhere (the service
// before or after its commit, the worker before, during or after its call)
// leaves one order, one job that runs to completion, and one shipment.
//
//	go run . -database-url postgres://postgres@127.0.0.1:5432/postgres
//	curl -u shop:secret -H 'Idempotency-Key: order-1' -d '{"item":"socks","qty":2}' http://127.0.0.1:8080/orders
//
// With -role service and -role worker, the two run as separate processes.
// Without -shipping-url, a fake shipping API runs in the worker's process.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverdatabasesql"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
	"github.com/idemkit/idem/server/sqlstore"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Getenv, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "outbox:", err)
		os.Exit(1)
	}
}

// config is the command line.
type config struct {
	role        string // service, worker or all
	addr        string
	databaseURL string
	shippingURL string
	store       string // pgx or sql: the service's key store and transaction
	service     serviceOptions
	worker      workerOptions
}

// stopTimeout bounds a graceful stop: the server's shutdown and River's.
const stopTimeout = 10 * time.Second

func parseFlags(args []string, getenv func(string) string, out io.Writer) (config, error) {
	var c config
	fs := flag.NewFlagSet("outbox", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.StringVar(&c.role, "role", "all", "what this process runs: service (POST /orders), worker (the shipping jobs) or all")
	fs.StringVar(&c.addr, "addr", "127.0.0.1:8080", "the service's listen address")
	fs.StringVar(&c.databaseURL, "database-url", getenv("DATABASE_URL"), "PostgreSQL (pgx connection string); default $DATABASE_URL")
	fs.StringVar(&c.shippingURL, "shipping-url", "", "base URL of the shipping API; empty: a fake one in this process")
	fs.StringVar(&c.store, "store", "pgx", "the service's keys and transaction: pgx (server/pgstore, a pgx.Tx, River's riverpgxv5) or sql (server/sqlstore on pgx's database/sql driver, a *sql.Tx, River's riverdatabasesql)")
	fs.BoolVar(&c.service.twoCommits, "two-commits", false,
		"claim each key in a commit of its own before the handler runs, as for a handler that calls other systems; default: the key, the order and its job in one transaction (idempotency.Options.OneTransaction)")
	fs.DurationVar(&c.service.lockTimeout, "lock-timeout", 0, "with -two-commits: how long a key whose service died stays locked (idempotency.Options.LockTimeout); 0: the library's default")
	fs.DurationVar(&c.service.delay, "order-delay", 0, "how long each order waits after its writes before it answers (demos and tests)")
	fs.IntVar(&c.worker.maxWorkers, "workers", 10, "shipping jobs run at once")
	fs.DurationVar(&c.worker.jobTimeout, "job-timeout", 0, "how long one run of a job may take (river.Config.JobTimeout); 0: River's default, 1m")
	fs.DurationVar(&c.worker.rescueAfter, "rescue-after", 0, "how long a job whose worker died stays running before it is run again (river.Config.RescueStuckJobsAfter); 0: River's default, 1h")
	fs.DurationVar(&c.worker.maxRetry, "max-retry-wait", 0, "the longest wait before a failed job runs again; 0: River's schedule (attempt⁴ seconds)")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	switch {
	case fs.NArg() > 0:
		return c, fmt.Errorf("unexpected arguments: %q", fs.Args())
	case c.role != "service" && c.role != "worker" && c.role != "all":
		return c, fmt.Errorf("-role %q: want service, worker or all", c.role)
	case c.store != "pgx" && c.store != "sql":
		return c, fmt.Errorf("-store %q: want pgx or sql", c.store)
	case c.databaseURL == "":
		return c, errors.New("-database-url or DATABASE_URL is required: the orders, the outbox and the keys live in PostgreSQL")
	}
	return c, nil
}

// run runs the roles the command line asks for until ctx is done.
func run(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	c, err := parseFlags(args, getenv, stdout)
	if err != nil {
		return err
	}
	log := slog.New(slog.NewJSONHandler(stdout, nil))
	c.service.log, c.worker.log = log, log
	pool, err := pgxpool.New(ctx, c.databaseURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := migrate(ctx, pool); err != nil {
		return err
	}

	var jobs *river.Client[pgx.Tx] // enqueues; in a worker, also works
	errc := make(chan error, 2)
	if c.role != "service" {
		shipping := c.shippingURL
		if shipping == "" {
			if shipping, err = serveFake(ctx, log); err != nil {
				return err
			}
		}
		jobs, err = newWorkerClient(pool, &shipWorker{pool: pool, client: newShippingClient(), shipping: shipping}, c.worker)
		if err != nil {
			return err
		}
		if err := jobs.Start(ctx); err != nil {
			return err
		}
		defer func() {
			stopCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), stopTimeout)
			defer cancel()
			jobs.Stop(stopCtx)
		}()
		log.Info("working", "queue", river.QueueDefault, "shipping_url", shipping)
	}
	if c.role != "worker" {
		// The key table, beside orders and River's jobs; a River client
		// with no queues only inserts: the service needs no workers.
		var (
			store  idempotency.Store
			orders orderWriter
		)
		switch c.store {
		case "sql":
			db := stdlib.OpenDBFromPool(pool)
			defer db.Close()
			inserter, err := river.NewClient(riverdatabasesql.New(db), &river.Config{Logger: log})
			if err != nil {
				return err
			}
			store, orders = sqlstore.New(db), sqlOrders{jobs: inserter}
		default:
			if jobs == nil {
				if jobs, err = river.NewClient(riverpgxv5.New(pool), &river.Config{Logger: log}); err != nil {
					return err
				}
			}
			store, orders = pgstore.New(pool), pgxOrders{jobs: jobs}
		}
		go (&idempotency.Purger{Store: store, Logger: log}).Run(ctx)
		srv, err := listen(ctx, c.addr, newService(store, orders, c.service), log, errc)
		if err != nil {
			return err
		}
		defer func() {
			stopCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), stopTimeout)
			defer cancel()
			srv.Shutdown(stopCtx)
		}()
	}
	select {
	case <-ctx.Done():
		return nil
	case err := <-errc:
		return err
	}
}

// listen serves h on addr, and says so in the log ("listening", with the
// address, which may have been "127.0.0.1:0"). A server that stops
// serving sends its error on errc.
func listen(ctx context.Context, addr string, h http.Handler, log *slog.Logger, errc chan<- error) (*http.Server, error) {
	ln, err := (&net.ListenConfig{}).Listen(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	log.Info("listening", "addr", ln.Addr().String())
	go func() {
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			errc <- err
		}
	}()
	return srv, nil
}

// serveFake runs the fake shipping API on a free loopback port until ctx
// is done, and returns its base URL.
func serveFake(ctx context.Context, log *slog.Logger) (string, error) {
	ln, err := (&net.ListenConfig{}).Listen(ctx, "tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	srv := &http.Server{Handler: &shippingAPI{}, ReadHeaderTimeout: 10 * time.Second}
	go srv.Serve(ln)
	context.AfterFunc(ctx, func() { srv.Close() })
	u := "http://" + ln.Addr().String()
	log.Info("shipping API (fake) listening", "url", u)
	return u, nil
}
