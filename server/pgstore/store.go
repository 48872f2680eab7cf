package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// PostgresStore is the PostgreSQL [Store], [PaymentStore] and [ChargeStore],
// on the tables of the embedded schema (see [Migrate]). It uses the database
// clock (now()) for every retention and lock-timeout decision, so any number
// of server processes can share one database.
//
// Each operation is one SQL statement in one round trip: a claim inserts,
// renews, resumes or takes over the key, or reads the live row, in one statement
// (run again in the rare case it lost a race); a completion writes the
// staged payments and completes the key in one statement, which commits
// both or neither. A request that claims, creates its payment and completes
// therefore costs two round trips and two commits (one with AsyncClaims);
// with BatchClaims (BatchCompletions), the claims of new keys (the
// completions) that arrive together share one statement, round trip and
// commit.
//
// When the connection breaks under a claim, a completion or a release, the
// store runs it once more on a live connection, in a way that is safe
// whether or not the lost statement committed: see [PostgresStore.Claim]; a
// completion (a release) that finds its key already completed (released)
// under its own fencing token is the lost one, committed, and succeeds. A connection breaks when PostgreSQL ends it
// (SQLSTATE 57P01 admin_shutdown, as after pg_terminate_backend or a fast
// restart, or a connection exception of class 08), or when it fails with no
// word from PostgreSQL: an EOF or a network error (a reset, a broken pipe)
// while the statement is sent or its answer read, as after a network cut, a
// crash of the server or a kill -9 of its process. A statement whose
// context is done is not run again, nor one that got no connection (the
// pool failed to connect). Other statements return the error.
//
// The zero value is not usable; call [NewPostgresStore]. A PostgresStore is
// safe for concurrent use by many goroutines and many processes.
type PostgresStore struct {
	pool *pgxpool.Pool

	// AsyncClaims makes claims commit without waiting for their WAL flush
	// (synchronous_commit = off for the claim's own transaction only),
	// which removes one disk flush per request. Defaults to false: every
	// claim is durable when Claim returns. Set it before first use.
	//
	// It is safe when nothing durable can happen under a claim's
	// [Claim.OperationID] before a synchronous commit to the same database
	// has flushed the WAL behind it, as in the reference server, where the
	// fake card processor writes its charges through this store. The
	// reasoning: a claim is visible to other requests at once (a duplicate
	// sees started and gets 409); if the database crashes before its
	// commit record reaches disk, the claim is gone, and so is everything
	// that depended on it, because any later synchronous commit (the
	// charge, the completion) flushes the WAL up to itself, claim included.
	// The client's retry then claims the key afresh. It is not safe when
	// the handler calls an external system keyed by the operation ID right
	// after the claim: the first claim of a key, lost in a crash, would give
	// the retry a new operation ID, and so a second downstream key. (A
	// lost claim of a released key is harmless: the durable released row
	// keeps the operation ID for the retry.)
	AsyncClaims bool

	// BatchClaims gathers the claims that arrive while another batch of
	// claims is running into one statement and one commit, which under
	// concurrent load claims many new keys for the price of one (see
	// batchClaimSQL). It changes nothing else: a key that has a row, and
	// every key of a batch that fails, is claimed by claimSQL as without
	// it, and a claim waits for no timer, only for the batch before it.
	// The price: a key that has a row (a replay, a duplicate, a retry
	// after a release) costs two round trips, the batch's and claimSQL's,
	// instead of one. Defaults to false. Set it before first use.
	BatchClaims bool

	// BatchCompletions gathers the completions that arrive while another
	// batch of completions is running into one statement and one commit
	// (see batchCompleteSQL), as BatchClaims does for claims. A batch that
	// fails (a payment that breaks a constraint fails the whole batch) is
	// run again one completion at a time, so each gets its own outcome.
	// Defaults to false. Set it before first use.
	BatchCompletions bool

	claims      batcher[*pendingClaim]
	completions batcher[*pendingCompletion]
}

// NewPostgresStore returns a store on pool, whose search_path must reach the
// tables created by [Migrate].
func NewPostgresStore(pool *pgxpool.Pool) *PostgresStore {
	return &PostgresStore{pool: pool}
}

// maxRaces bounds how often one call re-runs a statement that lost a race
// (see claimSQL); each re-run means another caller made progress.
const maxRaces = 10

// claimSQL claims, renews, resumes or takes over a key, or returns it as it
// is (see [Store.Claim] for the cases).
//
// Parameters: $1 client, $2 key, $3 method, $4 path, $5 fingerprint,
// $6 fingerprint version, $7 lock timeout and $8 retention in microseconds
// (0: never). It returns one row: outcome 1 (Claimed) or 2 (TookOver) with
// the new token and the operation ID, or 3 (Exists) with the row as the
// statement's snapshot saw it.
//
// existing reads the row without locking it, so a duplicate of a live key
// costs a read and no write (no transaction ID, no WAL, no flush), and does
// not queue behind the owner's completion. renewed updates the row in
// place when it is
//
//   - expired (created before now - retention: it counts as absent, whatever
//     its state and fingerprint): a new operation ID and creation time;
//   - released under the same fingerprint version: with the same
//     fingerprint it is resumed (same operation ID and creation time), with
//     another it is replaced (new operation ID, creation time, request) if
//     it was released as rejected (release_rejected), and left as it is,
//     for an Exists row, if it was released as failed;
//   - started, stale and with the same fingerprint: taken over (same
//     operation ID).
//
// Every case gets a new token and a fresh lock. Its WHERE is re-checked by
// PostgreSQL on the newest row version when another transaction changed
// the row first, so of many concurrent claimers of an expired, released or
// stale row exactly one wins; the re-check also requires the status the
// snapshot saw, so the outcome reported (Claimed for a new, expired or
// released row, TookOver for a stale started one) is the one that
// happened. inserted creates the row when the snapshot had none.
//
// The snapshot is taken when the statement starts, so it can miss a row
// another transaction has just inserted, or show one it has just renewed
// or released: the statement then returns no row, or an Exists row flagged
// lost, and the caller runs it again with a fresh snapshot.
const claimSQL = `
WITH existing AS (
    SELECT k.*,
        ($8::bigint > 0 AND k.created_at < now() - $8::bigint * interval '1 microsecond') AS expired,
        (k.status = 'started'
            AND $7::bigint > 0 AND k.locked_at < now() - $7::bigint * interval '1 microsecond'
            AND k.fingerprint_version = $6 AND k.request_hash = $5) AS stale,
        (k.status = 'released' AND k.fingerprint_version = $6
            AND (k.release_rejected OR k.request_hash = $5)) AS free
    FROM idempotency_keys k
    WHERE k.client_id = $1 AND k.idempotency_key = $2
), renewed AS (
    UPDATE idempotency_keys k SET
        request_method = $3,
        request_path = $4,
        request_hash = $5,
        fingerprint_version = $6,
        status = 'started',
        operation_id = CASE
            WHEN ($8::bigint > 0 AND k.created_at < now() - $8::bigint * interval '1 microsecond')
                OR (k.status = 'released' AND k.request_hash <> $5)
            THEN gen_random_uuid() ELSE k.operation_id END,
        lock_token = nextval('idempotency_lock_tokens'),
        created_at = CASE
            WHEN ($8::bigint > 0 AND k.created_at < now() - $8::bigint * interval '1 microsecond')
                OR (k.status = 'released' AND k.request_hash <> $5)
            THEN now() ELSE k.created_at END,
        locked_at = now(),
        release_rejected = false,
        response_status = NULL,
        response_content_type = NULL,
        response_headers = NULL,
        response_body = NULL
    WHERE k.client_id = $1 AND k.idempotency_key = $2
        AND k.status = (SELECT status FROM existing)
        AND (($8::bigint > 0 AND k.created_at < now() - $8::bigint * interval '1 microsecond')
            OR (k.status = 'released' AND k.fingerprint_version = $6
                AND (k.release_rejected OR k.request_hash = $5))
            OR (k.status = 'started'
                AND $7::bigint > 0 AND k.locked_at < now() - $7::bigint * interval '1 microsecond'
                AND k.fingerprint_version = $6 AND k.request_hash = $5))
    RETURNING k.lock_token, k.operation_id,
        k.created_at = now() OR (SELECT status FROM existing) = 'released' AS claimed
), inserted AS (
    INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path,
        request_hash, fingerprint_version, status, operation_id, lock_token, created_at, locked_at)
    SELECT $1, $2, $3, $4, $5, $6, 'started', gen_random_uuid(), nextval('idempotency_lock_tokens'), now(), now()
    WHERE NOT EXISTS (SELECT FROM existing)
    ON CONFLICT (client_id, idempotency_key) DO NOTHING
    RETURNING lock_token, operation_id
)
SELECT 1, lock_token, operation_id::text,
    NULL::text, NULL::text, NULL::bytea, NULL::integer, NULL::text,
    NULL::integer, NULL::text, NULL::jsonb, NULL::bytea, NULL::timestamptz, NULL::timestamptz, false
FROM inserted
UNION ALL
SELECT CASE WHEN claimed THEN 1 ELSE 2 END, lock_token, operation_id::text,
    NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, false
FROM renewed
UNION ALL
SELECT 3, NULL, NULL,
    request_method, request_path, request_hash, fingerprint_version, status,
    response_status, response_content_type, response_headers, response_body, created_at, locked_at,
    expired OR stale OR free
FROM existing
WHERE NOT EXISTS (SELECT FROM renewed)`

// asyncCommitSQL turns synchronous_commit off for the current transaction
// only; sent in one batch with the claim, it covers the claim's implicit
// transaction (see [PostgresStore.AsyncClaims]).
const asyncCommitSQL = `SELECT set_config('synchronous_commit', 'off', true)`

// claimRow is one row of claimSQL.
type claimRow struct {
	outcome            Outcome
	token              *int64
	operationID        *string
	method, path       *string
	fingerprint        []byte
	fingerprintVersion *int32
	status             *string
	respStatus         *int32
	respContentType    *string
	respHeader         map[string]string
	respBody           []byte
	createdAt          *time.Time
	lockedAt           *time.Time
	lost               bool
}

// Claim implements [Store.Claim] in one statement (see claimSQL), re-run
// when it lost a race to a concurrent writer of the same key.
//
// When the connection broke under the statement, ended by PostgreSQL or
// failed without a word from it (see errConnLost), and ctx is not done,
// Claim runs it once more on a connection that answers: the statement is
// one transaction, so a retry is safe whatever became of the first. Lost
// before its commit (or before it reached PostgreSQL), it did nothing, and
// the retry claims. Lost after, only its answer is gone, and the retry
// finds the key started and answers Exists: the caller's 409 sends the
// client back after Retry-After, and the key is taken over after the lock
// timeout. Either way the key has one owner at most.
func (s *PostgresStore) Claim(ctx context.Context, req ClaimRequest) (ClaimResult, error) {
	if s.BatchClaims {
		switch c, claimed, err := s.batchClaim(ctx, req); {
		case err != nil:
			return ClaimResult{}, err
		case claimed:
			return ClaimResult{Outcome: Claimed, Claim: c}, nil
		}
	}
	retried := false
	for range maxRaces {
		row, found, err := s.claimOnce(ctx, s.pool, req)
		if err = interpretError(err); errors.Is(err, errConnLost) && !retried && ctx.Err() == nil {
			retried = true
			err = interpretError(s.onLiveConn(ctx, func(q querier) (err error) {
				row, found, err = s.claimOnce(ctx, q, req)
				return err
			}))
		}
		if err != nil {
			return ClaimResult{}, err
		}
		if !found || row.lost {
			continue
		}
		switch row.outcome {
		case Claimed, TookOver:
			return ClaimResult{Outcome: row.outcome, Claim: Claim{
				ClientID:    req.ClientID,
				Key:         req.Key,
				Token:       *row.token,
				OperationID: *row.operationID,
			}}, nil
		}
		rec := &Record{
			ClientID:           req.ClientID,
			Key:                req.Key,
			Method:             *row.method,
			Path:               *row.path,
			Fingerprint:        row.fingerprint,
			FingerprintVersion: int(*row.fingerprintVersion),
			Status:             Status(*row.status),
			CreatedAt:          *row.createdAt,
		}
		if row.lockedAt != nil {
			rec.LockedAt = *row.lockedAt
		}
		if rec.Status == StatusCompleted {
			rec.Response = &StoredResponse{
				Status: int(*row.respStatus),
				Header: row.respHeader,
				Body:   row.respBody,
			}
			if row.respContentType != nil {
				rec.Response.ContentType = *row.respContentType
			}
		}
		return ClaimResult{Outcome: Exists, Record: rec}, nil
	}
	return ClaimResult{}, fmt.Errorf("server: claim of key %q lost %d races in a row", req.Key, maxRaces)
}

// querier runs statements: a *pgxpool.Pool, or one *pgxpool.Conn of it.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// claimOnce runs claimSQL once on q; found is false when it returned no row.
func (s *PostgresStore) claimOnce(ctx context.Context, q querier, req ClaimRequest) (row claimRow, found bool, err error) {
	args := []any{req.ClientID, req.Key, req.Method, req.Path, req.Fingerprint, req.FingerprintVersion,
		req.LockTimeout.Microseconds(), req.Retention.Microseconds()}
	var rows pgx.Rows
	if s.AsyncClaims {
		b := &pgx.Batch{}
		b.Queue(asyncCommitSQL)
		b.Queue(claimSQL, args...)
		br := q.SendBatch(ctx, b)
		defer func() {
			if cerr := br.Close(); err == nil {
				err = cerr
			}
		}()
		if _, err := br.Exec(); err != nil {
			return row, false, err
		}
		rows, err = br.Query()
	} else {
		rows, err = q.Query(ctx, claimSQL, args...)
	}
	if err != nil {
		return row, false, err
	}
	defer rows.Close()
	if !rows.Next() {
		return row, false, rows.Err()
	}
	var outcome int32
	err = rows.Scan(&outcome, &row.token, &row.operationID,
		&row.method, &row.path, &row.fingerprint, &row.fingerprintVersion, &row.status,
		&row.respStatus, &row.respContentType, &row.respHeader, &row.respBody, &row.createdAt, &row.lockedAt,
		&row.lost)
	if err != nil {
		return row, false, err
	}
	row.outcome = Outcome(outcome)
	rows.Close()
	return row, true, rows.Err()
}

// Begin implements [Store.Begin]. It does not touch the database: the
// returned [Tx] stages the payments made through it, and [Tx.Complete]
// writes them with the key's completion in one statement. No connection is
// held, and no transaction is left open, while the handler runs (and calls
// the card processor, which may need a connection of the same pool).
func (s *PostgresStore) Begin(ctx context.Context, c Claim) (Tx, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return &pgTx{store: s, claim: c}, nil
}

// Release implements [Store.Release] in one statement: the row is marked
// released, with its kind in release_rejected, and keeps its operation ID,
// request and creation time (see
// claimSQL for what a claim does with it). Its lock token stays too; it no
// longer owns the key, since completion and release require a started row.
//
// When the connection broke under the statement (see errConnLost), Release
// runs it once more on a live connection, as Complete does: if the first
// did not commit, the second releases; if it did, the second finds nothing
// to release, and the key is then released under this claim's token, which
// only this release can have done, so Release succeeds. A key that is
// neither (completed, or claimed again under another token meanwhile) is
// [ErrFenced], as without the retry.
func (s *PostgresStore) Release(ctx context.Context, c Claim, kind ReleaseKind) error {
	rejected := kind == ReleaseRejected
	tag, err := s.pool.Exec(ctx, releaseSQL, c.ClientID, c.Key, c.Token, rejected)
	released := tag.RowsAffected() > 0
	if err = interpretError(err); errors.Is(err, errConnLost) && ctx.Err() == nil {
		err = interpretError(s.onLiveConn(ctx, func(q querier) error {
			tag, err := q.Exec(ctx, releaseSQL, c.ClientID, c.Key, c.Token, rejected)
			if released = tag.RowsAffected() > 0; err != nil || released {
				return err
			}
			released, err = hasStatusUnder(ctx, q, c, StatusReleased)
			return err
		}))
	}
	if err != nil {
		return err
	}
	if !released {
		return ErrFenced
	}
	return nil
}

// releaseSQL releases a key its claim still owns ($1 client, $2 key, $3
// token), as rejected or not ($4; see [ReleaseKind]).
const releaseSQL = `
UPDATE idempotency_keys SET status = 'released', release_rejected = $4
WHERE client_id = $1 AND idempotency_key = $2 AND lock_token = $3 AND status = 'started'`

// Purge implements [Store.Purge]. One call is one short statement: it walks
// the created_at index from the oldest key, locks at most limit expired keys
// of any status (skipping those another transaction holds) and deletes them
// by their physical address. A retention or limit that is zero or negative
// purges nothing.
func (s *PostgresStore) Purge(ctx context.Context, retention time.Duration, limit int) (int64, error) {
	if retention <= 0 || limit <= 0 {
		return 0, nil
	}
	tag, err := s.pool.Exec(ctx, purgeSQL, retention.Microseconds(), limit)
	if err != nil {
		return 0, interpretError(err)
	}
	return tag.RowsAffected(), nil
}

// purgeSQL deletes a bounded batch of expired keys: $1 retention in
// microseconds, $2 the batch size. ctid = ANY (ARRAY(...)) is planned as a
// TID scan, never a scan of the whole table.
const purgeSQL = `
DELETE FROM idempotency_keys
WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM idempotency_keys
    WHERE created_at < now() - $1::bigint * interval '1 microsecond'
    ORDER BY created_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED))`

// CreatePayment implements [PaymentStore.CreatePayment]: it stages p on tx,
// which must come from s.Begin. The payment is written by tx.Complete, in
// the statement that completes the key; a constraint it breaks surfaces
// there, as [ErrDuplicatePayment] for a payment ID or (client, operation)
// already stored.
func (s *PostgresStore) CreatePayment(ctx context.Context, tx Tx, p Payment) error {
	ptx, ok := tx.(*pgTx)
	if !ok || ptx.store != s {
		return fmt.Errorf("server: CreatePayment needs a Tx from the same PostgresStore, got %T", tx)
	}
	ptx.mu.Lock()
	defer ptx.mu.Unlock()
	if ptx.done {
		return errTxDone
	}
	ptx.payments = append(ptx.payments, p)
	return nil
}

// insertPaymentSQL inserts one payment outside any key's completion.
const insertPaymentSQL = `
INSERT INTO payments (payment_id, client_id, customer_id, amount, currency,
    idempotency_key, operation_id, charge_id, created_at)
VALUES ($1, $2, $3, $4, $5, $6, nullif($7, '')::uuid, nullif($8, ''), coalesce($9, now()))`

// InsertPayment implements [PaymentInserter] in one autocommitted
// statement. A payment without CreatedAt gets the current time.
func (s *PostgresStore) InsertPayment(ctx context.Context, p Payment) error {
	created := pgtype.Timestamptz{Time: p.CreatedAt, Valid: !p.CreatedAt.IsZero()}
	_, err := s.pool.Exec(ctx, insertPaymentSQL, p.ID, p.ClientID, p.Customer, p.Amount, p.Currency,
		p.IdempotencyKey, p.OperationID, p.ChargeID, created)
	return interpretError(err)
}

// GetPayment implements [PaymentStore.GetPayment].
func (s *PostgresStore) GetPayment(ctx context.Context, clientID, id string) (Payment, error) {
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
// like claimSQL it returns no row when it lost a race, and is run again.
// An empty charge ID gets a generated one, an unset time the current one.
const createChargeSQL = `
WITH inserted AS (
    INSERT INTO charges (charge_id, idempotency_key, amount, currency, created_at)
    VALUES (coalesce(nullif($1, ''), 'ch_' || replace(gen_random_uuid()::text, '-', '')), $2, $3, $4, coalesce($5, now()))
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING charge_id, idempotency_key, amount, currency, created_at
)
SELECT charge_id, idempotency_key, amount, currency, created_at, true FROM inserted
UNION ALL
SELECT charge_id, idempotency_key, amount, currency, created_at, false FROM charges
WHERE idempotency_key = $2 AND NOT EXISTS (SELECT FROM inserted)`

// CreateCharge implements [ChargeStore.CreateCharge] in one statement. A
// charge with no ID gets a generated one; with no CreatedAt, the current
// time.
func (s *PostgresStore) CreateCharge(ctx context.Context, c Charge) (stored Charge, created bool, err error) {
	createdAt := pgtype.Timestamptz{Time: c.CreatedAt, Valid: !c.CreatedAt.IsZero()}
	for range maxRaces {
		err = s.pool.QueryRow(ctx, createChargeSQL, c.ID, c.IdempotencyKey, c.Amount, c.Currency, createdAt).
			Scan(&stored.ID, &stored.IdempotencyKey, &stored.Amount, &stored.Currency, &stored.CreatedAt, &created)
		if !errors.Is(err, pgx.ErrNoRows) {
			break
		}
	}
	if err != nil {
		return Charge{}, false, interpretError(err)
	}
	return stored, created, nil
}

// pgTx is the unit of work of a claim on a PostgresStore. It is safe for
// concurrent use, though a handler has no reason to share it.
type pgTx struct {
	store *PostgresStore
	claim Claim

	mu       sync.Mutex
	done     bool
	payments []Payment // staged by CreatePayment
}

// completeSQL completes the key if the claim still owns it and, only then,
// inserts the staged payments, passed as parallel arrays ($8 to $16). It is
// one autocommitted statement, so the payments and the completion commit
// together or not at all. It returns how many keys it completed (0 or 1:
// 0 means fenced, and then nothing was written).
const completeSQL = `
WITH done AS (
    UPDATE idempotency_keys SET
        status = 'completed',
        response_status = $4,
        response_content_type = $5,
        response_headers = $6,
        response_body = $7
    WHERE client_id = $1 AND idempotency_key = $2 AND lock_token = $3 AND status = 'started'
    RETURNING 1
), paid AS (
    INSERT INTO payments (payment_id, client_id, customer_id, amount, currency,
        idempotency_key, operation_id, charge_id, created_at)
    SELECT p.id, p.client_id, p.customer, p.amount, p.currency,
        p.key, nullif(p.operation, '')::uuid, nullif(p.charge, ''), coalesce(p.created_at, now())
    FROM unnest($8::text[], $9::text[], $10::text[], $11::bigint[], $12::text[],
            $13::text[], $14::text[], $15::text[], $16::timestamptz[])
        AS p(id, client_id, customer, amount, currency, key, operation, charge, created_at)
    WHERE EXISTS (SELECT FROM done)
    RETURNING 1
)
SELECT (SELECT count(*) FROM done), (SELECT count(*) FROM paid)`

// Complete implements [Tx.Complete] in one statement (see completeSQL).
//
// When the connection broke under the statement, ended by PostgreSQL or
// failed without a word from it (see errConnLost), and ctx is not done,
// Complete runs it once more on a connection that answers. Lost before its
// commit (or before it reached PostgreSQL), the first wrote nothing, and
// the retry completes the key. Lost after, the retry finds the key
// completed and writes nothing; a key completed under this claim's token
// was completed by the lost statement, and Complete succeeds.
func (tx *pgTx) Complete(ctx context.Context, resp StoredResponse) error {
	tx.mu.Lock()
	defer tx.mu.Unlock()
	if tx.done {
		return errTxDone
	}
	tx.done = true
	staged := tx.payments
	tx.payments = nil
	c := tx.claim
	batched := tx.store.BatchCompletions
	if batched {
		if completed, ok := tx.store.batchComplete(c, resp, staged); ok {
			if !completed {
				return ErrFenced
			}
			return nil
		}
		// The batch failed, and may have committed (its connection lost):
		// completeSQL below decides, as after a lost completeSQL.
	}

	n := len(staged)
	ids, clients, customers := make([]string, n), make([]string, n), make([]string, n)
	amounts, currencies, keys := make([]int64, n), make([]string, n), make([]string, n)
	operations, charges, created := make([]string, n), make([]string, n), make([]pgtype.Timestamptz, n)
	for i, p := range staged {
		ids[i], clients[i], customers[i] = p.ID, p.ClientID, p.Customer
		amounts[i], currencies[i], keys[i] = p.Amount, p.Currency, p.IdempotencyKey
		operations[i], charges[i] = p.OperationID, p.ChargeID
		created[i] = pgtype.Timestamptz{Time: p.CreatedAt, Valid: !p.CreatedAt.IsZero()}
	}
	var header any // SQL NULL when there is nothing to replay
	if len(resp.Header) > 0 {
		header = resp.Header
	}
	args := []any{c.ClientID, c.Key, c.Token, resp.Status, resp.ContentType, header, resp.Body,
		ids, clients, customers, amounts, currencies, keys, operations, charges, created}
	var completed, paid int64
	err := tx.store.pool.QueryRow(ctx, completeSQL, args...).Scan(&completed, &paid)
	if err = interpretError(err); errors.Is(err, errConnLost) && ctx.Err() == nil {
		// Whether the lost statement committed is unknown. Run it again:
		// it completes the key if the first did not commit; if the first
		// did, it finds the key completed and writes nothing, and the key
		// is then completed under this claim's token, which only this
		// completion can have done (a token names one ownership; a
		// takeover or a new claim takes another).
		err = interpretError(tx.store.onLiveConn(ctx, func(q querier) error {
			if err := q.QueryRow(ctx, completeSQL, args...).Scan(&completed, &paid); err != nil || completed > 0 {
				return err
			}
			ours, err := hasStatusUnder(ctx, q, c, StatusCompleted)
			if ours {
				completed = 1
			}
			return err
		}))
	}
	if err == nil && completed == 0 && batched {
		// After a failed batch: completed by the batch, or fenced.
		var ours bool
		ours, err = hasStatusUnder(ctx, tx.store.pool, c, StatusCompleted)
		if ours {
			completed = 1
		}
		err = interpretError(err)
	}
	if err != nil {
		return err
	}
	if completed == 0 {
		return ErrFenced
	}
	return nil
}

// hasStatusUnder tells whether c's key has status under c's lock token:
// after a lost statement of c's owner, whether that statement committed,
// since a token names one ownership (a takeover or a new claim takes
// another) and only the owner completes or releases under it. A key that
// is gone (purged) has not.
func hasStatusUnder(ctx context.Context, q querier, c Claim, status Status) (bool, error) {
	var ours bool
	err := q.QueryRow(ctx, statusUnderSQL, c.ClientID, c.Key, c.Token, string(status)).Scan(&ours)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	return ours, err
}

// statusUnderSQL tells whether a key has a status under a lock token ($1
// client, $2 key, $3 token, $4 status).
const statusUnderSQL = `
SELECT status = $4 AND lock_token = $3 FROM idempotency_keys
WHERE client_id = $1 AND idempotency_key = $2`

// onLiveConn runs f on a connection of the pool that answers a ping, for
// the one retry of a statement whose connection PostgreSQL ended. The
// pool's idle connections may have been ended with it (a restart of the
// server, pg_terminate_backend of every backend), and the pool finds out
// only by using them: each one that fails its ping is closed, which drops
// it from the pool, and the next is tried, up to the pool's size plus one
// (a new connection, then).
func (s *PostgresStore) onLiveConn(ctx context.Context, f func(q querier) error) error {
	var err error
	for range s.pool.Stat().MaxConns() + 1 {
		var c *pgxpool.Conn
		if c, err = s.pool.Acquire(ctx); err != nil {
			return err
		}
		if err = c.Ping(ctx); err != nil {
			dead := c.Conn().IsClosed()
			c.Release()
			if dead && ctx.Err() == nil {
				continue
			}
			return err
		}
		err = f(c)
		c.Release()
		return err
	}
	return err
}

// Rollback implements [Tx.Rollback]: it drops the staged payments. Nothing
// was written before Complete, so there is nothing to undo in the database.
func (tx *pgTx) Rollback(ctx context.Context) error {
	tx.mu.Lock()
	defer tx.mu.Unlock()
	tx.done = true
	tx.payments = nil
	return nil
}

// interpretError translates an error of pgx into the package's sentinels,
// by SQLSTATE, constraint name and error type, never by message:
// [ErrNotFound] for no row, [ErrDuplicatePayment] for a payment's unique
// violation, errConnLost for a broken connection (see connBroken). Errors
// it does not know are wrapped with the package prefix. errors.Is and
// errors.As still reach the errors inside: the *pgconn.PgError, the
// context's error, the net.Error.
func interpretError(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, pgx.ErrNoRows) {
		return ErrNotFound
	}
	if connBroken(err) {
		return fmt.Errorf("%w: %w", errConnLost, err)
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == uniqueViolation && (pgErr.ConstraintName == "payments_pkey" ||
		pgErr.ConstraintName == "payments_client_operation_key") {
		return fmt.Errorf("%w: %w", ErrDuplicatePayment, err)
	}
	return fmt.Errorf("server: postgres: %w", err)
}

// connBroken reports whether err says that the connection broke under a
// statement, rather than that the statement failed (see errConnLost).
//
// pgconn closes the connection on any error of its own reads and writes
// and returns that error as it came (wrapped, for a write, in an error
// whose SafeToRetry is true when nothing was sent): an io.EOF or
// io.ErrUnexpectedEOF when the peer closed it, a net.Error (a
// *net.OpError around syscall.ECONNRESET, EPIPE, ETIMEDOUT) when the
// network failed. It closes it too when the statement's context is done,
// and then returns the context's error instead: the caller gave up, and
// that is not a broken connection. Neither is a *pgconn.ConnectError,
// though it may wrap a net.Error: the pool found no connection to send the
// statement on, and a second dial right away would meet the same refusal.
func connBroken(err error) bool {
	var (
		pgErr      *pgconn.PgError
		connectErr *pgconn.ConnectError
		netErr     net.Error
	)
	switch {
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return false
	case errors.As(err, &connectErr):
		return false
	case errors.As(err, &pgErr):
		return pgErr.Code == adminShutdown || strings.HasPrefix(pgErr.Code, connectionException)
	}
	return pgconn.SafeToRetry(err) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.As(err, &netErr)
}

// SQLSTATEs that interpretError knows.
const (
	uniqueViolation     = "23505" // unique_violation
	adminShutdown       = "57P01" // admin_shutdown: pg_terminate_backend, a fast shutdown
	connectionException = "08"    // the class of connection exceptions
)

// errConnLost marks an error of a statement whose connection broke under
// it: PostgreSQL ended it (admin_shutdown, or a connection exception), or
// it failed with no word from PostgreSQL (an EOF, or a network error such
// as a reset or a broken pipe) while the statement was sent or its answer
// read. The connection is gone, and the statement may or may not have
// committed; when pgconn.SafeToRetry(err) is true it was not even sent.
// Errors of a statement whose context is done are not marked, though pgx
// closes the connection under them, and nor are failures to connect (see
// connBroken). [PostgresStore] retries Claim, Complete and Release once on
// another connection, in the ways that are safe for each, unless their
// context is done; other statements return it to the caller.
var errConnLost = errors.New("server: postgres: connection lost")
