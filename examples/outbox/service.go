package main

import (
	"encoding/json"
	"log/slog"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
)

// serviceOptions configures the order service.
type serviceOptions struct {
	twoCommits  bool          // claim each key in a commit of its own (the default for handlers that call other systems)
	lockTimeout time.Duration // idempotency.Options.LockTimeout, with twoCommits; 0: the library's default
	delay       time.Duration // how long an order waits after its writes before it answers
	log         *slog.Logger
}

// newService returns the order service: POST /orders behind the
// idempotency middleware on store, which keeps its keys in the database of
// the orders and of River's jobs. The handler writes nothing anywhere else:
// its order, its job and the key's outcome commit together, in one
// transaction with the key's claim (idempotency.Options.OneTransaction). jobs only
// enqueues; the workers may run in other processes.
func newService(store *pgstore.Store, jobs *river.Client[pgx.Tx], opts serviceOptions) http.Handler {
	keyed := idempotency.Middleware(store, idempotency.Options{
		// The handler writes only to this database, so its key, its order
		// and its job commit in one transaction: a killed service leaves
		// nothing, and the client's retry runs at once.
		OneTransaction: !opts.twoCommits,
		LockTimeout:    opts.lockTimeout,
		BodyFormat:     idempotency.BodyAsJSON,
		ClientID: func(r *http.Request) (string, bool) { // your own authentication scopes the keys
			user, password, ok := r.BasicAuth()
			return user, ok && password == "secret"
		},
		Logger: opts.log,
	})
	o := &orderHandler{jobs: jobs, delay: opts.delay, log: opts.log}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", keyed(http.HandlerFunc(o.create)))
	return mux
}

// orderHandler creates orders.
type orderHandler struct {
	jobs  *river.Client[pgx.Tx]
	delay time.Duration
	log   *slog.Logger
}

// order is the body of POST /orders and of its answer.
type order struct {
	ID   int64  `json:"id,omitempty"`
	Item string `json:"item"`
	Qty  int    `json:"qty"`
}

// create writes the order and enqueues its shipment in the key's
// transaction, and answers 201 with the order. The shipment is the
// follow-up work: a worker calls the shipping API later, keyed by the
// claim's operation, so that neither a crash here nor one there ships twice.
func (o *orderHandler) create(w http.ResponseWriter, r *http.Request) {
	var in order
	if json.NewDecoder(r.Body).Decode(&in) != nil || in.Item == "" || in.Qty < 1 {
		http.Error(w, `want {"item": "...", "qty": 1 or more}`, http.StatusBadRequest) // the key stays free
		return
	}
	ctx := r.Context()
	tenant, _ := idempotency.ClientIDFromContext(ctx)
	claim, ok := idempotency.ClaimFromContext(ctx)
	if !ok {
		http.Error(w, "POST /orders is served without the idempotency middleware", http.StatusInternalServerError)
		return
	}
	tx, err := pgstore.Tx(ctx) // commits with the key's stored outcome
	if err != nil {
		http.Error(w, "the database is unavailable; retry with the same key", http.StatusServiceUnavailable)
		return
	}
	err = tx.QueryRow(ctx, `INSERT INTO orders (tenant, operation_id, item, qty) VALUES ($1, $2, $3, $4) RETURNING id`,
		tenant, claim.OperationID, in.Item, in.Qty).Scan(&in.ID)
	if err == nil {
		// The outbox: the job is a row in the same transaction, so it exists
		// if and only if the order does.
		_, err = o.jobs.InsertTx(ctx, tx, shipArgs{
			OrderID:     in.ID,
			Tenant:      tenant,
			OperationID: claim.OperationID,
			Item:        in.Item,
			Qty:         in.Qty,
		}, nil)
	}
	if err != nil {
		o.log.Error("outbox: order not written", "err", err)
		http.Error(w, "try again with the same key", http.StatusServiceUnavailable) // the order and the job roll back
		return
	}
	if o.delay > 0 {
		select {
		case <-time.After(o.delay):
		case <-ctx.Done():
			http.Error(w, "the request was cancelled", http.StatusServiceUnavailable) // the order and the job roll back
			return
		}
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	json.NewEncoder(w).Encode(in)
}
