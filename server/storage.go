package server

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

// Errors of the reference server's stores.
var (
	// ErrNotFound is returned by lookups that find nothing.
	ErrNotFound = errors.New("server: not found")
	// ErrDuplicatePayment is returned by [PaymentStore.CreatePayment] for a
	// payment that repeats the ID or the (client, operation) of a stored
	// one; nothing is stored then, and the request's unit of work goes on.
	ErrDuplicatePayment = errors.New("server: duplicate payment")
)

// Payment is one payment of the reference API.
type Payment struct {
	ID             string
	ClientID       string
	Customer       string
	Amount         int64
	Currency       string
	IdempotencyKey string // the key the payment was created with; "" without one ([Config.NoIdempotency])
	OperationID    string // [idempotency.Claim.OperationID]; unique per client: the safety net once the key is purged
	ChargeID       string // the card processor's charge
	CreatedAt      time.Time
}

// PaymentStore keeps the payments of the reference API, as a service keeps
// its own rows behind [idempotency.Middleware].
type PaymentStore interface {
	// CreatePayment writes p. Inside a request that owns its key, it
	// writes in the request's unit of work, so the payment commits with
	// the key's stored outcome, or not at all; anywhere else it writes in
	// a transaction of its own.
	CreatePayment(ctx context.Context, p Payment) error
	// GetPayment returns the client's payment, or ErrNotFound (also for
	// another client's payment).
	GetPayment(ctx context.Context, clientID, id string) (Payment, error)
}

// Charge is one charge made by the fake card processor.
type Charge struct {
	ID             string
	IdempotencyKey string // derived by the payments API from (client, operation)
	Amount         int64
	Currency       string
	// Customer is the customer charged, as a real processor keeps it
	// (Stripe's charge.customer): the sweeper writes a payment from the
	// charge alone. "" for the charges of an earlier server.
	Customer  string
	CreatedAt time.Time
}

// ChargeStore keeps the fake card processor's charges.
type ChargeStore interface {
	// CreateCharge inserts c, or returns the charge already stored under
	// c.IdempotencyKey with created false. It is atomic: concurrent calls
	// with one key create one charge.
	CreateCharge(ctx context.Context, c Charge) (stored Charge, created bool, err error)
	// ChargeByKey returns the charge stored under idempotencyKey, or
	// ErrNotFound.
	ChargeByKey(ctx context.Context, idempotencyKey string) (Charge, error)
}

// Storage is where a [Server] keeps its keys, its payments and its fake
// processor's charges: all in memory ([NewMemoryStorage]) or all in one
// PostgreSQL database ([NewPostgresStorage]).
type Storage struct {
	Keys     idempotency.Store
	Payments PaymentStore
	Charges  ChargeStore
}

// MemoryStorage is the in-memory [Storage]: a [idempotency.MemoryStore]
// for the keys, and payments and charges in maps, the payments staged in
// the key's unit of work with [idempotency.MemoryStore.Stage]. Its contents
// die with the process.
type MemoryStorage struct {
	keys *idempotency.MemoryStore

	mu        sync.Mutex
	payments  map[string]Payment // by ID
	paymentOp map[[2]string]bool // (client, operation ID) of stored payments
	charges   map[string]Charge  // by idempotency key
}

// NewMemoryStorage returns empty in-memory storage.
func NewMemoryStorage() *MemoryStorage {
	return &MemoryStorage{
		keys:      idempotency.NewMemoryStore(),
		payments:  make(map[string]Payment),
		paymentOp: make(map[[2]string]bool),
		charges:   make(map[string]Charge),
	}
}

// Storage returns the three stores of m.
func (m *MemoryStorage) Storage() Storage {
	return Storage{Keys: m.keys, Payments: m, Charges: m}
}

// Keys returns the key store.
func (m *MemoryStorage) Keys() *idempotency.MemoryStore { return m.keys }

// CreatePayment implements [PaymentStore]: inside a request that owns its
// key, the payment is staged and stored when the key completes.
func (m *MemoryStorage) CreatePayment(ctx context.Context, p Payment) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := checkPaymentText(p); err != nil {
		return err
	}
	if p.CreatedAt.IsZero() {
		p.CreatedAt = time.Now()
	}
	if m.taken(p) {
		return ErrDuplicatePayment
	}
	if m.keys.Stage(ctx, func() error { return m.insert(p) }) {
		return nil
	}
	return m.insert(p)
}

// checkPaymentText refuses the text PostgreSQL's payments table refuses.
func checkPaymentText(p Payment) error {
	for _, s := range []string{p.ID, p.ClientID, p.Customer, p.Currency, p.IdempotencyKey, p.OperationID, p.ChargeID} {
		if !idempotency.ValidText(s) {
			return fmt.Errorf("server: payment %w: %q", idempotency.ErrInvalidText, s)
		}
	}
	return nil
}

// taken reports whether p repeats a stored payment's ID or (client,
// operation).
func (m *MemoryStorage) taken(p Payment) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.takenLocked(p)
}

func (m *MemoryStorage) takenLocked(p Payment) bool {
	_, dup := m.payments[p.ID]
	return dup || (p.OperationID != "" && m.paymentOp[[2]string{p.ClientID, p.OperationID}])
}

// insert stores p unless it repeats a stored payment's ID or (client,
// operation).
func (m *MemoryStorage) insert(p Payment) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	op := [2]string{p.ClientID, p.OperationID}
	if m.takenLocked(p) {
		return ErrDuplicatePayment
	}
	m.payments[p.ID] = p
	if p.OperationID != "" {
		m.paymentOp[op] = true
	}
	return nil
}

// GetPayment implements [PaymentStore].
func (m *MemoryStorage) GetPayment(ctx context.Context, clientID, id string) (Payment, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	p, ok := m.payments[id]
	if !ok || p.ClientID != clientID {
		return Payment{}, ErrNotFound
	}
	return p, nil
}

// CreateCharge implements [ChargeStore]. A charge with no CreatedAt gets
// the current time.
func (m *MemoryStorage) CreateCharge(ctx context.Context, c Charge) (Charge, bool, error) {
	if err := ctx.Err(); err != nil {
		return Charge{}, false, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if stored, ok := m.charges[c.IdempotencyKey]; ok {
		return stored, false, nil
	}
	if c.CreatedAt.IsZero() {
		c.CreatedAt = time.Now()
	}
	m.charges[c.IdempotencyKey] = c
	return c, true, nil
}

// ChargeByKey implements [ChargeStore].
func (m *MemoryStorage) ChargeByKey(ctx context.Context, idempotencyKey string) (Charge, error) {
	if err := ctx.Err(); err != nil {
		return Charge{}, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	c, ok := m.charges[idempotencyKey]
	if !ok {
		return Charge{}, ErrNotFound
	}
	return c, nil
}

// Charges returns every charge, oldest first; tests and the scenarios use
// it to count what reached the card processor.
func (m *MemoryStorage) Charges() []Charge {
	m.mu.Lock()
	defer m.mu.Unlock()
	all := slices.Collect(maps.Values(m.charges))
	slices.SortFunc(all, func(a, b Charge) int {
		return cmp.Or(a.CreatedAt.Compare(b.CreatedAt), cmp.Compare(a.ID, b.ID))
	})
	return all
}

// Payments returns every committed payment, oldest first; tests and the
// scenarios use it to count what was really paid. Payments staged on a
// unit of work that has not completed are not in it.
func (m *MemoryStorage) Payments() []Payment {
	m.mu.Lock()
	defer m.mu.Unlock()
	all := slices.Collect(maps.Values(m.payments))
	slices.SortFunc(all, func(a, b Payment) int {
		return cmp.Or(a.CreatedAt.Compare(b.CreatedAt), cmp.Compare(a.ID, b.ID))
	})
	return all
}
