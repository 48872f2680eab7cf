package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"log/slog"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
	"github.com/idemkit/idem/server/sqlstore"
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
func newService(store idempotency.Store, orders orderWriter, opts serviceOptions) http.Handler {
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
	o := &orderHandler{orders: orders, delay: opts.delay, log: opts.log}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", keyed(http.HandlerFunc(o.create)))
	return mux
}

// orderHandler creates orders.
type orderHandler struct {
	orders orderWriter
	delay  time.Duration
	log    *slog.Logger
}

// orderWriter writes an order and enqueues its shipment in the key's
// transaction (the outbox), on the transaction of the store's driver.
type orderWriter interface {
	write(ctx context.Context, tenant string, claim idempotency.Claim, in *order) error
}

// pgxOrders writes through pgstore.Tx, a pgx.Tx, and River's riverpgxv5.
type pgxOrders struct{ jobs *river.Client[pgx.Tx] }

func (o pgxOrders) write(ctx context.Context, tenant string, claim idempotency.Claim, in *order) error {
	tx, err := pgstore.Tx(ctx) // commits with the key's stored outcome
	if err != nil {
		return err
	}
	err = tx.QueryRow(ctx, insertOrderSQL, tenant, claim.OperationID, in.Item, in.Qty).Scan(&in.ID)
	if err != nil {
		return err
	}
	// The outbox: the job is a row in the same transaction, so it exists
	// if and only if the order does.
	_, err = o.jobs.InsertTx(ctx, tx, shipArgsOf(tenant, claim, in), nil)
	return err
}

// sqlOrders writes through sqlstore.Tx, a *sql.Tx, and River's
// riverdatabasesql.
type sqlOrders struct{ jobs *river.Client[*sql.Tx] }

func (o sqlOrders) write(ctx context.Context, tenant string, claim idempotency.Claim, in *order) error {
	tx, err := sqlstore.Tx(ctx) // commits with the key's stored outcome
	if err != nil {
		return err
	}
	err = tx.QueryRowContext(ctx, insertOrderSQL, tenant, claim.OperationID, in.Item, in.Qty).Scan(&in.ID)
	if err != nil {
		return err
	}
	_, err = o.jobs.InsertTx(ctx, tx, shipArgsOf(tenant, claim, in), nil)
	return err
}

// insertOrderSQL writes an order: $1 tenant, $2 operation, $3 item, $4 qty.
const insertOrderSQL = `INSERT INTO orders (tenant, operation_id, item, qty) VALUES ($1, $2, $3, $4) RETURNING id`

// shipArgsOf is the shipment job of an order.
func shipArgsOf(tenant string, claim idempotency.Claim, in *order) shipArgs {
	return shipArgs{OrderID: in.ID, Tenant: tenant, OperationID: claim.OperationID, Item: in.Item, Qty: in.Qty}
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
	err := o.orders.write(ctx, tenant, claim, &in)
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
