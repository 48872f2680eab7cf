package server

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
)

// PostgresStorage is the PostgreSQL [Storage] on the tables of [Migrate]:
// the keys in a [pgstore.Store], the payments written through
// [pgstore.Tx] as any service writes its rows, and the charges.
// It is safe for concurrent use by many goroutines and many processes.
type PostgresStorage struct {
	pool *pgxpool.Pool
	keys *pgstore.Store
}

// NewPostgresStorage returns the storage on pool, whose search_path must
// reach the tables created by [Migrate].
func NewPostgresStorage(pool *pgxpool.Pool) *PostgresStorage {
	return &PostgresStorage{pool: pool, keys: pgstore.New(pool)}
}

// Storage returns the three stores of s.
func (s *PostgresStorage) Storage() Storage {
	return Storage{Keys: s.keys, Payments: s, Charges: s}
}

// Keys returns the key store, to set its options before first use.
func (s *PostgresStorage) Keys() *pgstore.Store { return s.keys }

// insertPaymentSQL inserts one payment, or nothing when its ID or its
// (client, operation) is taken: a duplicate fails no transaction, so the
// handler can still answer with the stored payment and have that stored
// with the key. A payment without CreatedAt gets the current time.
const insertPaymentSQL = `
INSERT INTO payments (payment_id, client_id, customer_id, amount, currency,
    idempotency_key, operation_id, charge_id, created_at)
VALUES ($1, $2, $3, $4, $5, $6, nullif($7, '')::uuid, nullif($8, ''), coalesce($9, now()))
ON CONFLICT DO NOTHING`

// CreatePayment implements [PaymentStore]: inside a request that owns its
// key, in the request's transaction ([pgstore.Tx]); anywhere
// else in a transaction of its own, the same BEGIN, INSERT and COMMIT a
// service without the middleware would send.
func (s *PostgresStorage) CreatePayment(ctx context.Context, p Payment) error {
	if err := checkPaymentText(p); err != nil {
		return err
	}
	created := pgtype.Timestamptz{Time: p.CreatedAt, Valid: !p.CreatedAt.IsZero()}
	insert := func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, insertPaymentSQL, p.ID, p.ClientID, p.Customer, p.Amount, p.Currency,
			p.IdempotencyKey, p.OperationID, p.ChargeID, created)
		if err == nil && tag.RowsAffected() == 0 {
			return ErrDuplicatePayment
		}
		return err
	}
	tx, err := pgstore.Tx(ctx)
	switch {
	case errors.Is(err, pgstore.ErrNoTx):
		err = pgx.BeginFunc(ctx, s.pool, insert)
	case err == nil:
		err = insert(tx)
	}
	return interpretError(err)
}

// GetPayment implements [PaymentStore]. An id or client that is not valid
// text names no payment (PostgreSQL would refuse to compare it).
func (s *PostgresStorage) GetPayment(ctx context.Context, clientID, id string) (Payment, error) {
	if !idempotency.ValidText(id) || !idempotency.ValidText(clientID) {
		return Payment{}, ErrNotFound
	}
	var p Payment
	err := s.pool.QueryRow(ctx, `
		SELECT payment_id, client_id, customer_id, amount, currency, idempotency_key,
			operation_id::text, coalesce(charge_id, ''), created_at
		FROM payments
		WHERE payment_id = $1 AND client_id = $2`, id, clientID).
		Scan(&p.ID, &p.ClientID, &p.Customer, &p.Amount, &p.Currency, &p.IdempotencyKey,
			&p.OperationID, &p.ChargeID, &p.CreatedAt)
	if err != nil {
		return Payment{}, interpretError(err)
	}
	return p, nil
}

// createChargeSQL inserts a charge or returns the one stored under its key;
// it returns no row when it lost a race, and is run again. An empty charge
// ID gets a generated one, an unset time the current one.
const createChargeSQL = `
WITH inserted AS (
    INSERT INTO charges (charge_id, idempotency_key, amount, currency, customer_id, created_at)
    VALUES (coalesce(nullif($1, ''), 'ch_' || replace(gen_random_uuid()::text, '-', '')), $2, $3, $4, nullif($6, ''),
        coalesce($5, now()))
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING charge_id, idempotency_key, amount, currency, customer_id, created_at
)
SELECT ` + chargeColumns + `, true FROM inserted
UNION ALL
SELECT ` + chargeColumns + `, false FROM charges
WHERE idempotency_key = $2 AND NOT EXISTS (SELECT FROM inserted)`

// chargeColumns are the columns of a Charge, in scanCharge's order.
const chargeColumns = `charge_id, idempotency_key, amount, currency, coalesce(customer_id, ''), created_at`

// maxRaces bounds how often CreateCharge runs its statement again after
// losing a race.
const maxRaces = 10

// CreateCharge implements [ChargeStore] in one statement.
func (s *PostgresStorage) CreateCharge(ctx context.Context, c Charge) (stored Charge, created bool, err error) {
	createdAt := pgtype.Timestamptz{Time: c.CreatedAt, Valid: !c.CreatedAt.IsZero()}
	for range maxRaces {
		err = s.pool.QueryRow(ctx, createChargeSQL, c.ID, c.IdempotencyKey, c.Amount, c.Currency, createdAt, c.Customer).
			Scan(&stored.ID, &stored.IdempotencyKey, &stored.Amount, &stored.Currency, &stored.Customer, &stored.CreatedAt, &created)
		if !errors.Is(err, pgx.ErrNoRows) {
			break
		}
	}
	if err != nil {
		return Charge{}, false, interpretError(err)
	}
	return stored, created, nil
}

// ChargeByKey implements [ChargeStore]. A key that is not valid text names
// no charge.
func (s *PostgresStorage) ChargeByKey(ctx context.Context, idempotencyKey string) (Charge, error) {
	var c Charge
	if !idempotency.ValidText(idempotencyKey) {
		return c, ErrNotFound
	}
	err := s.pool.QueryRow(ctx, `SELECT `+chargeColumns+` FROM charges WHERE idempotency_key = $1`, idempotencyKey).
		Scan(&c.ID, &c.IdempotencyKey, &c.Amount, &c.Currency, &c.Customer, &c.CreatedAt)
	if err != nil {
		return Charge{}, interpretError(err)
	}
	return c, nil
}

// interpretError translates the errors of pgx the server knows, by
// SQLSTATE and constraint name: [ErrNotFound] for no row,
// [ErrDuplicatePayment] for a payment's unique violation.
func interpretError(err error) error {
	var pgErr *pgconn.PgError
	switch {
	case err == nil:
		return nil
	case errors.Is(err, pgx.ErrNoRows):
		return ErrNotFound
	case errors.As(err, &pgErr) && pgErr.Code == "23505" &&
		(pgErr.ConstraintName == "payments_pkey" || pgErr.ConstraintName == "payments_client_operation_key"):
		return fmt.Errorf("%w: %w", ErrDuplicatePayment, err)
	}
	return fmt.Errorf("server: postgres: %w", err)
}
