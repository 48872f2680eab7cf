package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	"github.com/idemkit/idem"
)

// shipArgs is the job enqueued with each order: everything the worker
// needs, so that every run of the job sends the shipping API the same
// request.
type shipArgs struct {
	OrderID     int64  `json:"order_id"`
	Tenant      string `json:"tenant"`
	OperationID string `json:"operation_id"` // idempotency.Claim.OperationID of the order's request
	Item        string `json:"item"`
	Qty         int    `json:"qty"`
}

// Kind names the job in River's table.
func (shipArgs) Kind() string { return "ship_order" }

// shipmentSpace is the UUID namespace of shipment keys.
var shipmentSpace = uuid.MustParse("5b0d6f3e-9c2a-4f51-8e7d-2f1c3a4b5d60")

// shipmentKey is the Idempotency-Key of the shipment of an operation: a
// UUIDv5 of the tenant (length-prefixed, so that no two pairs meet) and the
// operation id, the same on every run of the job, whichever worker runs it. It derives from [idempotency.Claim]'s
// OperationID rather than from the client's key for the reasons the
// reference server's charge key does (server/payments.go): the operation is
// kept across takeovers and retries, and is new when a key is reused after
// it expired.
func shipmentKey(tenant, operationID string) string {
	return uuid.NewSHA1(shipmentSpace, fmt.Appendf(nil, "%d:%s%s", len(tenant), tenant, operationID)).String()
}

// shipWorker ships orders: it asks the shipping API for the order's
// shipment, and records the shipment on the order in the transaction that
// completes the job.
type shipWorker struct {
	river.WorkerDefaults[shipArgs]
	pool     *pgxpool.Pool
	client   *http.Client // its Transport is an idem.Transport
	shipping string       // base URL of the shipping API
}

// shipment is the shipping API's answer.
type shipment struct {
	ID string `json:"id"`
}

// Work runs one attempt of a job. An attempt that dies anywhere (its
// process killed, the answer lost) is run again by River; it sends the same
// key, and the shipping API answers with the shipment it already made.
func (w *shipWorker) Work(ctx context.Context, job *river.Job[shipArgs]) error {
	a := job.Args
	body, err := json.Marshal(map[string]any{
		"reference": a.Tenant + "/" + strconv.FormatInt(a.OrderID, 10),
		"item":      a.Item,
		"qty":       a.Qty,
	})
	if err != nil {
		return err
	}
	ctx = idem.WithKey(ctx, shipmentKey(a.Tenant, a.OperationID))
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, w.shipping+"/v1/shipments", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := w.client.Do(req) // retried with the same key until an answer or the job's timeout
	if err != nil {
		var reuse *idem.KeyReuseError
		if errors.As(err, &reuse) {
			return river.JobCancel(err) // the key holds another shipment: no retry can fix that
		}
		return err // outcome unknown: River runs the job again, with the same key
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		err := fmt.Errorf("shipping API: %s", resp.Status)
		if resp.StatusCode < 500 {
			return river.JobCancel(err)
		}
		return err
	}
	var s shipment
	if err := json.NewDecoder(resp.Body).Decode(&s); err != nil || s.ID == "" {
		return fmt.Errorf("shipping API: unreadable answer: %v", err)
	}
	return pgx.BeginFunc(ctx, w.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `UPDATE orders SET shipment_id = $1 WHERE id = $2`, s.ID, a.OrderID); err != nil {
			return err
		}
		_, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job)
		return err
	})
}

// workerOptions configures the River client that works the jobs.
type workerOptions struct {
	maxWorkers  int           // jobs run at once
	jobTimeout  time.Duration // river.Config.JobTimeout; 0: River's default (1 minute)
	rescueAfter time.Duration // river.Config.RescueStuckJobsAfter; 0: River's default (1 hour)
	maxRetry    time.Duration // the longest wait before a failed job runs again; 0: River's schedule
	log         *slog.Logger
}

// newWorkerClient returns a River client that works the shipping jobs
// with w.
func newWorkerClient(pool *pgxpool.Pool, w *shipWorker, opts workerOptions) (*river.Client[pgx.Tx], error) {
	workers := river.NewWorkers()
	if err := river.AddWorkerSafely(workers, w); err != nil {
		return nil, err
	}
	cfg := &river.Config{
		Logger:               opts.log,
		Queues:               map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: max(opts.maxWorkers, 1)}},
		Workers:              workers,
		JobTimeout:           opts.jobTimeout,
		RescueStuckJobsAfter: opts.rescueAfter,
	}
	if opts.maxRetry > 0 {
		cfg.RetryPolicy = &cappedRetry{max: opts.maxRetry}
	}
	return river.NewClient(riverpgxv5.New(pool), cfg)
}

// cappedRetry is River's retry schedule (attempt⁴ seconds) with a cap, for
// a job that is safe to run again at once: its downstream call is keyed.
type cappedRetry struct {
	river.DefaultClientRetryPolicy
	max time.Duration
}

// NextRetry returns River's next retry time, or max from now if sooner.
func (p *cappedRetry) NextRetry(job *rivertype.JobRow) time.Time {
	next, latest := p.DefaultClientRetryPolicy.NextRetry(job), time.Now().Add(p.max)
	if next.After(latest) {
		return latest
	}
	return next
}

// newShippingClient returns the worker's HTTP client: an idem.Transport,
// which sends the key pinned on each request's context and retries
// timeouts, lost connections and 5xx with it.
func newShippingClient() *http.Client {
	return &http.Client{Transport: &idem.Transport{}}
}
