package pgstore

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
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/server/idempotency"
)

// Store is the PostgreSQL [idempotency.Store], on the key table created by
// [Migrate]. It uses the database clock for every lease and retention
// decision, and the lease and retention stored with each key, so any
// number of processes, with any settings, can share one table. The clock
// is statement_timestamp(), the time the statement arrived, never now(),
// the start of its transaction: a completion runs inside the handler's
// transaction, which may have begun long before, and the key's retention
// counts from the completion.
//
// Each operation on a key is one SQL statement in one round trip, but for
// the claims of keys that have a row: a claim inserts a new key in one
// (claimInsertSQL), reads the row of a key it could not insert (a replay, a
// duplicate) in two, and resumes, replaces or takes over a key in three (see
// claimReadSQL), or more in the rare case it lost a race to another
// writer of the key; a renewal, a release and a completion
// each update the row under the claim's fencing token. A completion whose
// handler wrote through [TxFromContext] is the last statement of the
// handler's transaction, sent with its COMMIT in one round trip, so the
// handler's rows and the key's outcome commit together or not at all.
//
// When the connection breaks under a claim, a renewal, a release or a
// completion without a handler transaction, the store runs it once more on
// a live connection, in a way that is safe whether or not the lost
// statement committed: see [Store.Claim]; a completion (a release) that
// finds its key already completed (released) under its own fencing token is
// the lost one, committed, and succeeds. A connection breaks when
// PostgreSQL ends it (SQLSTATE 57P01 admin_shutdown, as after
// pg_terminate_backend or a fast restart, or a connection exception of
// class 08), or when it fails with no word from PostgreSQL: an EOF or a
// network error (a reset, a broken pipe) while the statement is sent or its
// answer read. A statement whose context is done is not run again, nor one
// that got no connection (the pool failed to connect). Other statements
// return the error.
//
// The store's statements run in the database's default isolation level.
// Under REPEATABLE READ or SERIALIZABLE, one that loses a race for a key's
// row fails with a serialization failure where READ COMMITTED would wait
// and read the row again: it did nothing, and the store runs it again, as
// it runs again a claim that lost a race under READ COMMITTED. See
// [TxFromContext] for the lease of a handler transaction under those
// levels.
//
// The zero value is not usable; call [New]. A Store is safe for concurrent
// use by many goroutines and many processes.
type Store struct {
	pool *pgxpool.Pool

	// AsyncClaims makes claims commit without waiting for their WAL flush
	// (synchronous_commit = off for the claim's own transaction only),
	// which removes one disk flush per request. Defaults to false: every
	// claim is durable when Claim returns. Set it before first use.
	//
	// It is safe when nothing durable can happen under a claim's
	// [idempotency.Claim.OperationID] before a synchronous commit to the
	// same database has flushed the WAL behind it. The reasoning: a claim
	// is visible to other requests at once (a duplicate sees started and
	// gets 409); if the database crashes before its commit record reaches
	// disk, the claim is gone, and so is everything that depended on it,
	// because any later synchronous commit (a write of the handler's, the
	// completion) flushes the WAL up to itself, claim included. The
	// client's retry then claims the key afresh. It is not safe when the
	// handler calls an external system keyed by the operation ID right
	// after the claim: the first claim of a key, lost in a crash, would
	// give the retry a new operation ID, and so a second downstream key.
	// (A lost claim of a released key is harmless: the durable released
	// row keeps the operation ID for the retry.)
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

	claims batcher[*pendingClaim]

	unitsMu sync.Mutex
	units   map[int64]*unit // the units of work of this process, by lock token (see Renew)
}

// New returns a store on pool, whose search_path must reach the table
// created by [Migrate].
func New(pool *pgxpool.Pool) *Store {
	return &Store{pool: pool}
}

// maxRaces bounds how often one call re-runs a statement that lost a race
// (see claimSQL); each re-run means another caller made progress.
const maxRaces = 10

// Expressions over a key row k shared by the statements below. A lease or
// retention of 0 microseconds means "never".
const (
	// staleExpr: k is started and its owner stopped renewing its lease.
	staleExpr = `(k.status = 'started' AND k.lease_us > 0 AND k.locked_at < statement_timestamp() - k.lease_us * interval '1 microsecond')`
	// expiredExpr: k counts as absent. Its expiry is computed from
	// locked_at, which is the last claim or renewal of a started key and
	// the time a finished one finished: a started key expires retention
	// after its lease runs out, a finished one retention after it
	// finished; never without a retention, nor while started without a
	// lease. expires_at is not the expiry but a bound below it, which the
	// purge walks in its index: this package writes the claim's time plus
	// the retention (NULL while started without a lease, or without a
	// retention), which is never after the expiry, and leaves it alone
	// afterwards, so that a renewal, a completion and a release change no
	// column of the primary key's index or of expires_at's (PostgreSQL
	// then deletes those indexes' stale entries bottom-up; the updates
	// would be HOT, adding nothing to any index, but for
	// idempotency_keys_open_idx, which reads status and locked_at: see
	// TestFinishIsHOT) (a completion lowers it to the expiry of a key
	// whose expires_at is later, or sets it on one whose expires_at is
	// NULL: a key claimed without a lease, or by a replica of the previous
	// release, which wrote the expiry itself, as finishedExpiryExpr did).
	// The greatest() covers every other writer: replicas of the previous
	// release, which write the expiry itself, and those of an idem-server
	// from before this package, which claim, take over, resume, complete
	// and release keys without touching expires_at (see
	// schema/legacy_replicas.sql), while they serve beside this one during
	// a rolling upgrade; their rows and this package's read the same.
	expiredExpr = `(k.retention_us > 0 AND (k.status <> 'started' OR k.lease_us > 0)
        AND ` + expiryTimeExpr + ` < statement_timestamp())`
	// expiryTimeExpr is when k starts counting as absent, for a key that
	// expires at all (see expiredExpr); expiryExpr is that or NULL (never).
	expiryTimeExpr = `greatest(k.expires_at, k.locked_at + (k.retention_us
            + CASE WHEN k.status = 'started' THEN k.lease_us ELSE 0 END) * interval '1 microsecond')`
	expiryExpr = `(CASE WHEN k.retention_us > 0 AND (k.status <> 'started' OR k.lease_us > 0)
        THEN ` + expiryTimeExpr + ` END)`
	// refusedExpr: k is expired and the claim's first-sent check ($9
	// stale, $10 earliest begin, NULL for none) says the request may belong
	// to its operation (see idempotency.FirstSentCheck).
	refusedExpr = `((` + expiredExpr + `) AND ($9::boolean OR k.created_at >= $10::timestamptz) IS TRUE)`
	// claimedExpiryExpr is the expires_at of a key claimed now with the
	// lease $7 and the retention $8: now plus the retention, a bound below
	// the key's expiry (see expiredExpr), or NULL for a key that never
	// expires while started.
	claimedExpiryExpr = `CASE WHEN $7::bigint > 0 AND $8::bigint > 0
            THEN statement_timestamp() + $8::bigint * interval '1 microsecond' END`
	// finishedSetExpr sets the columns of a key that finishes now: locked_at
	// to now, and expires_at to the key's expiry if that is earlier, or if
	// expires_at is NULL; for a key this package claimed with a lease it
	// is not, and expires_at stays as it was (see expiredExpr).
	finishedSetExpr = `locked_at = statement_timestamp(),
    expires_at = CASE WHEN retention_us > 0
        THEN least(expires_at, statement_timestamp() + retention_us * interval '1 microsecond') END`
)

// claimSQL claims, resumes or takes over a key, or returns it as it is (see
// [idempotency.Store.Claim] for the cases).
//
// Parameters: $1 client, $2 key, $3 method, $4 path, $5 fingerprint,
// $6 fingerprint version, $7 lease and $8 retention in microseconds
// (0: never), stored with the key. It returns one row: outcome 1 (Claimed)
// or 2 (TookOver) with the new token and the operation ID, or 3 (Exists)
// with the row as the statement's snapshot saw it.
//
// existing reads the row without locking it, so a duplicate of a live key
// costs a read and no write (no transaction ID, no WAL, no flush), and does
// not queue behind the owner's completion. renewed updates the row in
// place when it is
//
//   - expired (expires_at passed: it counts as absent, whatever its state
//     and fingerprint): a new operation ID and creation time;
//   - released under the same fingerprint version: with the same
//     fingerprint it is resumed (same operation ID and creation time), with
//     another it is replaced (new operation ID, creation time, request) if
//     it was released as rejected (release_rejected), and left as it is,
//     for an Exists row, if it was released as failed;
//   - started, its lease run out (by the lease stored with it, not the
//     caller's), and with the same fingerprint: taken over (same
//     operation ID).
//
// Every case gets a new token, a fresh lease and the caller's lease and
// retention. Its WHERE is re-checked by PostgreSQL on the newest row
// version when another transaction changed the row first, so of many
// concurrent claimers of an expired, released or stale row exactly one
// wins; the re-check also requires the status the snapshot saw, so the
// outcome reported (Claimed for a new, expired or released row, TookOver
// for a stale started one) is the one that happened. inserted creates the
// row when the snapshot had none.
//
// The snapshot is taken when the statement starts, so it can miss a row
// another transaction has just inserted, or show one it has just renewed
// or released: the statement then returns no row, or an Exists row flagged
// lost, and the caller runs it again with a fresh snapshot.
const claimSQL = `
WITH ` + existingCTE + `, renewed AS (
    UPDATE idempotency_keys k SET
        request_method = $3,
        request_path = $4,
        request_hash = $5,
        fingerprint_version = $6,
        status = 'started',
        operation_id = CASE
            WHEN ` + expiredExpr + ` IS TRUE OR (k.status = 'released' AND k.request_hash <> $5)
            THEN gen_random_uuid() ELSE k.operation_id END,
        lock_token = nextval('idempotency_lock_tokens'),
        created_at = CASE
            WHEN ` + expiredExpr + ` IS TRUE OR (k.status = 'released' AND k.request_hash <> $5)
            THEN statement_timestamp() ELSE k.created_at END,
        locked_at = statement_timestamp(),
        lease_us = $7,
        retention_us = $8,
        expires_at = ` + claimedExpiryExpr + `,
        release_rejected = false,
        response_status = NULL,
        response_content_type = NULL,
        response_headers = NULL,
        response_body = NULL
    WHERE k.client_id = $1 AND k.idempotency_key = $2
        AND k.status = (SELECT status FROM existing)
        AND NOT ` + refusedExpr + `
        AND (` + expiredExpr + `
            OR (k.status = 'released' AND k.fingerprint_version = $6
                AND (k.release_rejected OR k.request_hash = $5))
            OR (` + staleExpr + ` AND k.fingerprint_version = $6 AND k.request_hash = $5))
    RETURNING k.lock_token, k.operation_id,
        k.created_at = statement_timestamp() OR (SELECT status FROM existing) = 'released' AS claimed
), ` + insertedCTE + `
SELECT 1, lock_token, operation_id::text,
    NULL::text, NULL::text, NULL::bytea, NULL::integer, NULL::text,
    NULL::integer, NULL::text, NULL::jsonb, NULL::bytea, NULL::timestamptz, NULL::timestamptz, false
FROM inserted
UNION ALL
SELECT CASE WHEN claimed THEN 1 ELSE 2 END, lock_token, operation_id::text,
    NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, false
FROM renewed
UNION ALL
` + existingRow + `
WHERE NOT EXISTS (SELECT FROM renewed)
UNION ALL
` + refusedAbsentRow

// claimInsertSQL is the claim that Claim runs first (without BatchClaims,
// and for a request whose first-sent check is not stale, which must not
// insert the key): a plain insert of the key's row, started, which inserts
// nothing when the key has a row. A new key, the common case, costs
// PostgreSQL the insert alone: no read of the row first, no subquery, no
// CTE to set up (a sixth less CPU than a statement that reads the row and
// inserts it when it is absent; see bench/pgcost). It returns the new token
// and operation ID, or no row, and then Claim reads the row with
// claimReadSQL. Parameters $1 to $8 as claimSQL's.
const claimInsertSQL = `
INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path,
    request_hash, fingerprint_version, status, operation_id, lock_token, created_at, locked_at,
    lease_us, retention_us, expires_at)
VALUES ($1, $2, $3, $4, $5, $6, 'started', gen_random_uuid(), nextval('idempotency_lock_tokens'),
    statement_timestamp(), statement_timestamp(), $7, $8, ` + claimedExpiryExpr + `)
ON CONFLICT (client_id, idempotency_key) DO NOTHING
RETURNING lock_token, operation_id::text`

// claimReadSQL reads the row of a key that claimInsertSQL could not insert,
// or that a stale request claims: outcome 3 (Exists), or 4 (Refused),
// flagged (lost) when claimSQL would renew it (expired, free or stale), in
// which case the caller runs claimSQL; outcome 4 for a stale request whose
// key is absent; no row for any other absent key (deleted since the insert
// failed), which claimSQL then inserts. So a replay and a duplicate of a
// live key cost two statements, the failed insert and this read, and only a
// key that is taken over, resumed or replaced costs three. Same parameters
// and rows as claimSQL.
const claimReadSQL = `
WITH ` + existingCTE + `, typed AS (
    SELECT $3::text, $4::text, $7::bigint, $8::bigint -- unused: typed for the prepared statement
)
` + existingRow + `
UNION ALL
` + refusedAbsentRow

// The parts that claimSQL, claimReadSQL and claimTxSQL share. existingCTE reads the
// key's row without locking it, with what claimSQL may do with it:
// expired, stale or free. insertedCTE creates the row when the snapshot
// had none; ON CONFLICT DO NOTHING covers a row inserted since. existingRow
// is the outcome 3 row, flagged (lost) when the row can be renewed.
const (
	existingCTE = `existing AS (
    SELECT k.*,
        ` + expiredExpr + ` IS TRUE AS expired,
        ` + refusedExpr + ` AS refused,
        (` + staleExpr + ` AND k.fingerprint_version = $6 AND k.request_hash = $5) AS stale,
        (k.status = 'released' AND k.fingerprint_version = $6
            AND (k.release_rejected OR k.request_hash = $5)) AS free
    FROM idempotency_keys k
    WHERE k.client_id = $1 AND k.idempotency_key = $2
)`
	insertedCTE = `inserted AS (
    INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path,
        request_hash, fingerprint_version, status, operation_id, lock_token, created_at, locked_at,
        lease_us, retention_us, expires_at)
    SELECT $1, $2, $3, $4, $5, $6, 'started', gen_random_uuid(), nextval('idempotency_lock_tokens'), statement_timestamp(), statement_timestamp(),
        $7, $8, ` + claimedExpiryExpr + `
    WHERE NOT EXISTS (SELECT FROM existing) AND NOT $9::boolean
    ON CONFLICT (client_id, idempotency_key) DO NOTHING
    RETURNING lock_token, operation_id
)`
	existingRow = `SELECT CASE WHEN refused THEN 4 ELSE 3 END, NULL, NULL,
    request_method, request_path, request_hash, fingerprint_version, status,
    response_status, response_content_type, response_headers, response_body, created_at, locked_at,
    (expired OR stale OR free) AND NOT refused
FROM existing`
	// refusedAbsentRow is the outcome 4 (Refused) row of a key the snapshot
	// did not have, for a stale first-sent check ($9), which inserted
	// nothing.
	refusedAbsentRow = `SELECT 4, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, false
WHERE $9::boolean AND NOT EXISTS (SELECT FROM existing)`
)

// asyncCommitSQL turns synchronous_commit off for the current transaction
// only; sent in one batch with the claim, it covers the claim's implicit
// transaction (see [Store.AsyncClaims]).
const asyncCommitSQL = `SELECT set_config('synchronous_commit', 'off', true)`

// claimRow is one row of claimSQL.
type claimRow struct {
	outcome            idempotency.Outcome
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
	lost               bool // outcome 3 of a row that claimSQL may renew: run claimSQL (again)
}

// micros returns d in microseconds for a lease or retention column: 0
// (never) for zero or less, at least 1 otherwise.
func micros(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return max(d.Microseconds(), 1)
}

// checkText refuses, before it reaches PostgreSQL, text that a text column
// would refuse (SQLSTATE 22021), so the store answers as the memory store.
func checkText(fields ...string) error {
	for _, f := range fields {
		if !idempotency.ValidText(f) {
			return fmt.Errorf("%w: %q", idempotency.ErrInvalidText, f)
		}
	}
	return nil
}

// Claim implements [idempotency.Store.Claim] in one statement for a new
// key (claimInsertSQL), a second to read a key that has a row
// (claimReadSQL), and claimSQL after it for a key to resume, replace or
// take over; claimSQL is re-run when it lost a race to a concurrent writer
// of the same key. A claim in one transaction
// ([idempotency.ClaimRequest.OneTransaction]) is claimTxSQL, sent with
// the BEGIN of the request's transaction, and claimSQL for a key to renew.
//
// When the connection broke under the statement, ended by PostgreSQL or
// failed without a word from it (see errConnLost), and ctx is not done,
// Claim runs it once more on a connection that answers: the statement is
// one transaction, so a retry is safe whatever became of the first. Lost
// before its commit (or before it reached PostgreSQL), it did nothing, and
// the retry claims. Lost after, only its answer is gone, and the retry
// finds the key started and answers Exists: the caller's 409 sends the
// client back after Retry-After, and the key is taken over once its lease
// runs out. Either way the key has one owner at most.
func (s *Store) Claim(ctx context.Context, req idempotency.ClaimRequest) (idempotency.ClaimResult, error) {
	if err := checkText(req.ClientID, req.Key, req.Method, req.Path); err != nil {
		return idempotency.ClaimResult{}, err
	}
	if req.OneTransaction {
		// A key that has a row to renew is claimed by claimSQL below.
		if res, ok, err := s.claimInTx(ctx, req); err != nil || ok {
			return res, err
		}
		return s.claimLoop(ctx, claimSQL, req)
	}
	if req.FirstSent.Stale { // a stale request must not insert the key
		return s.claimLoop(ctx, claimReadSQL, req)
	}
	claim := s.insertClaim
	if s.BatchClaims {
		claim = s.batchClaim
	}
	switch c, claimed, err := claim(ctx, req); {
	case err != nil:
		return idempotency.ClaimResult{}, err
	case claimed:
		return idempotency.ClaimResult{Outcome: idempotency.Claimed, Claim: c}, nil
	}
	sql := claimReadSQL
	if s.BatchClaims {
		// What the batch leaves needs claimSQL as often as not (a retry
		// after a release), so no read first.
		sql = claimSQL
	}
	return s.claimLoop(ctx, sql, req)
}

// insertClaim claims req's key with claimInsertSQL; claimed is false when
// the key has a row. When the connection broke under the insert, it runs it
// once more on a connection that answers (see Claim).
func (s *Store) insertClaim(ctx context.Context, req idempotency.ClaimRequest) (c idempotency.Claim, claimed bool, err error) {
	c = idempotency.Claim{ClientID: req.ClientID, Key: req.Key}
	insert := func(q querier) error {
		var rows pgx.Rows
		rows, err = s.query(ctx, q, claimInsertSQL, claimArgs(req)[:8])
		if err != nil {
			return err
		}
		if rows.Next() { // no row: the key has one
			if err = rows.Scan(&c.Token, &c.OperationID); err == nil {
				claimed = true
			}
		}
		rows.Close()
		return cmpErr(err, rows.Err())
	}
	for range maxRaces {
		claimed = false
		err = interpretError(insert(s.pool))
		if errors.Is(err, errConnLost) && ctx.Err() == nil {
			err = interpretError(s.onLiveConn(ctx, insert))
		}
		if !serializationFailure(err) || ctx.Err() != nil {
			break // else it lost a race under REPEATABLE READ or SERIALIZABLE, and did nothing
		}
	}
	return c, claimed, err
}

// claimLoop runs sql (claimReadSQL or claimSQL), then claimSQL while the
// key is to renew or a race was lost, and returns the outcome.
func (s *Store) claimLoop(ctx context.Context, sql string, req idempotency.ClaimRequest) (idempotency.ClaimResult, error) {
	retried := false
	for range maxRaces {
		row, found, err := s.claimOnce(ctx, s.pool, sql, req)
		if err = interpretError(err); errors.Is(err, errConnLost) && !retried && ctx.Err() == nil {
			retried = true
			err = interpretError(s.onLiveConn(ctx, func(q querier) (err error) {
				row, found, err = s.claimOnce(ctx, q, sql, req)
				return err
			}))
		}
		if serializationFailure(err) && ctx.Err() == nil {
			continue // lost a race under REPEATABLE READ or SERIALIZABLE: the statement did nothing
		}
		if err != nil {
			return idempotency.ClaimResult{}, err
		}
		if !found || row.lost {
			sql = claimSQL
			continue
		}
		return row.result(req), nil
	}
	return idempotency.ClaimResult{}, fmt.Errorf("pgstore: claim of key %q lost %d races in a row", req.Key, maxRaces)
}

// result is the outcome of a claim of req that returned row, which is not
// lost.
func (row *claimRow) result(req idempotency.ClaimRequest) idempotency.ClaimResult {
	switch row.outcome {
	case idempotency.Refused, idempotency.Busy:
		return idempotency.ClaimResult{Outcome: row.outcome}
	case idempotency.Claimed, idempotency.TookOver:
		return idempotency.ClaimResult{Outcome: row.outcome, Claim: idempotency.Claim{
			ClientID:    req.ClientID,
			Key:         req.Key,
			Token:       *row.token,
			OperationID: *row.operationID,
		}}
	}
	rec := &idempotency.Record{
		ClientID:           req.ClientID,
		Key:                req.Key,
		Method:             *row.method,
		Path:               *row.path,
		Fingerprint:        row.fingerprint,
		FingerprintVersion: int(*row.fingerprintVersion),
		Status:             idempotency.Status(*row.status),
		CreatedAt:          *row.createdAt,
	}
	if row.lockedAt != nil {
		rec.LockedAt = *row.lockedAt
	}
	if rec.Status == idempotency.StatusCompleted {
		rec.Response = &idempotency.StoredResponse{
			Status: int(*row.respStatus),
			Header: row.respHeader,
			Body:   row.respBody,
		}
		if row.respContentType != nil {
			rec.Response.ContentType = *row.respContentType
		}
	}
	return idempotency.ClaimResult{Outcome: idempotency.Exists, Record: rec}
}

// querier runs statements: a *pgxpool.Pool, or one *pgxpool.Conn of it.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// claimOnce runs sql (claimReadSQL or claimSQL) once on q; found is false
// when it returned no row.
func (s *Store) claimOnce(ctx context.Context, q querier, sql string, req idempotency.ClaimRequest) (row claimRow, found bool, err error) {
	if sql == claimReadSQL { // writes nothing: nothing to commit
		return scanClaim(q.Query(ctx, sql, claimArgs(req)...))
	}
	return scanClaim(s.query(ctx, q, sql, claimArgs(req)))
}

// query runs a claim statement on q, after asyncCommitSQL in the same
// round trip with AsyncClaims. Closing the rows ends the batch.
func (s *Store) query(ctx context.Context, q querier, sql string, args []any) (pgx.Rows, error) {
	if !s.AsyncClaims {
		return q.Query(ctx, sql, args...)
	}
	b := &pgx.Batch{}
	b.Queue(asyncCommitSQL)
	b.Queue(sql, args...)
	br := q.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil {
		br.Close()
		return nil, err
	}
	rows, err := br.Query()
	if err != nil {
		br.Close()
		return nil, err
	}
	return &batchRows{Rows: rows, br: br}, nil
}

// batchRows are the rows of the last statement of a batch: closing them
// closes the batch, whose error Err then returns.
type batchRows struct {
	pgx.Rows
	br  pgx.BatchResults
	err error
}

func (r *batchRows) Close() {
	r.Rows.Close()
	if r.br != nil {
		r.err = r.br.Close()
		r.br = nil
	}
}

func (r *batchRows) Err() error {
	if err := r.Rows.Err(); err != nil {
		return err
	}
	return r.err
}

// claimArgs returns the parameters of claimSQL and its kin for req.
func claimArgs(req idempotency.ClaimRequest) []any {
	var earliest *time.Time
	if !req.FirstSent.EarliestBegin.IsZero() {
		earliest = &req.FirstSent.EarliestBegin
	}
	return []any{req.ClientID, req.Key, req.Method, req.Path, req.Fingerprint, req.FingerprintVersion,
		micros(req.LockTimeout), micros(req.Retention), req.FirstSent.Stale, earliest}
}

// scanClaim reads the row of a claim statement from rows, as Query
// returned them with err, and closes them; found is false when there was
// no row.
func scanClaim(rows pgx.Rows, err error) (row claimRow, found bool, _ error) {
	if err != nil {
		if rows != nil {
			rows.Close()
		}
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
	row.outcome = idempotency.Outcome(outcome)
	rows.Close()
	return row, true, rows.Err()
}

// Begin implements [idempotency.Store.Begin]. It does not touch the
// database: the handler's transaction ([TxFromContext]) begins on its first
// statement, so no connection is held while the handler does anything else
// (a call to a slow downstream system, say).
func (s *Store) Begin(ctx context.Context, c idempotency.Claim) (idempotency.Tx, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if c.OneTransaction {
		return s.beginInTx(c), nil
	}
	u := &unit{store: s, claim: c, opened: true}
	s.register(u)
	return u, nil
}

// forget drops u, which is over, from the units that Renew looks up.
func (s *Store) forget(u *unit) {
	s.unitsMu.Lock()
	if s.units[u.claim.Token] == u {
		delete(s.units, u.claim.Token)
	}
	s.unitsMu.Unlock()
}

// unitOf returns the unit of work of c begun by this Store and not over,
// or nil.
func (s *Store) unitOf(c idempotency.Claim) *unit {
	s.unitsMu.Lock()
	defer s.unitsMu.Unlock()
	if u := s.units[c.Token]; u != nil && u.claim == c {
		return u
	}
	return nil
}

// renewSQL renews the lease of a key its claim still owns ($1 client, $2
// key, $3 token), by the lease stored with it: the lease, and the key's
// expiry with it, run from locked_at (see expiredExpr). It leaves
// expires_at as it is.
const renewSQL = `
UPDATE idempotency_keys SET locked_at = statement_timestamp()
WHERE client_id = $1 AND idempotency_key = $2 AND lock_token = $3 AND status = 'started'`

// Renew implements [idempotency.Store.Renew] in one statement. When the
// connection broke under it, it runs once more on a live connection: a
// renewal done twice is one renewal.
//
// While the claim's handler transaction ([TxFromContext]) is open under
// REPEATABLE READ or SERIALIZABLE, Renew only checks that c still owns the
// key, and returns ErrFenced if it does not: the transaction's completion
// updates the key row, which PostgreSQL refuses (a serialization failure)
// once another transaction has updated the row since the transaction's
// snapshot. The lease then runs out a lock timeout after the last renewal.
func (s *Store) Renew(ctx context.Context, c idempotency.Claim) error {
	if c.OneTransaction {
		return s.inTxOpen(ctx, c)
	}
	if u := s.unitOf(c); u != nil {
		return u.renew(ctx)
	}
	return s.ownedUpdate(ctx, c, renewSQL, nil, "")
}

// ownedSQL tells whether a claim still owns its key ($1 client, $2 key,
// $3 token).
const ownedSQL = `
SELECT EXISTS (SELECT FROM idempotency_keys
    WHERE client_id = $1 AND idempotency_key = $2 AND lock_token = $3 AND status = 'started')`

// checkOwned returns ErrFenced unless c still owns its key, reading the
// row without writing it.
func (s *Store) checkOwned(ctx context.Context, c idempotency.Claim) error {
	var owned bool
	if err := s.pool.QueryRow(ctx, ownedSQL, c.ClientID, c.Key, c.Token).Scan(&owned); err != nil {
		return interpretError(err)
	}
	if !owned {
		return idempotency.ErrFenced
	}
	return nil
}

// releaseSQL releases a key its claim still owns ($1 client, $2 key, $3
// token), as rejected or not ($4; see [idempotency.ReleaseKind]); the key
// expires its retention from now (see finishedSetExpr).
const releaseSQL = `
UPDATE idempotency_keys SET status = 'released', release_rejected = $4, ` + finishedSetExpr + `
WHERE client_id = $1 AND idempotency_key = $2 AND lock_token = $3 AND status = 'started'`

// Release implements [idempotency.Store.Release] in one statement: the row
// is marked released, with its kind in release_rejected, and keeps its
// operation ID, request and creation time (see claimSQL for what a claim
// does with it). Its lock token stays too; it no longer owns the key, since
// renewal, completion and release require a started row.
//
// When the connection broke under the statement (see errConnLost), Release
// runs it once more on a live connection: if the first did not commit, the
// second releases; if it did, the second finds nothing to release, and the
// key is then released under this claim's token, which only this release
// can have done, so Release succeeds. A key that is neither (completed, or
// claimed again under another token meanwhile) is
// [idempotency.ErrFenced], as without the retry.
func (s *Store) Release(ctx context.Context, c idempotency.Claim, kind idempotency.ReleaseKind) error {
	if c.OneTransaction {
		return s.releaseInTx(ctx, c)
	}
	return s.ownedUpdate(ctx, c, releaseSQL, []any{kind == idempotency.ReleaseRejected}, idempotency.StatusReleased)
}

// ownedUpdate runs sql, an UPDATE of c's key under c's token ($1 to $3,
// then more), and returns ErrFenced when it updated nothing. When the
// connection broke under it, it runs it once more on a live connection;
// if that updates nothing either and after is not empty, a key found in
// status after under c's token was updated by the lost statement.
func (s *Store) ownedUpdate(ctx context.Context, c idempotency.Claim, sql string, more []any, after idempotency.Status) error {
	args := append([]any{c.ClientID, c.Key, c.Token}, more...)
	tag, err := s.pool.Exec(ctx, sql, args...)
	for range maxRaces {
		if !serializationFailure(err) || ctx.Err() != nil {
			break
		}
		tag, err = s.pool.Exec(ctx, sql, args...) // it did nothing: run it again
	}
	done := tag.RowsAffected() > 0
	if err = interpretError(err); errors.Is(err, errConnLost) && ctx.Err() == nil {
		err = interpretError(s.onLiveConn(ctx, func(q querier) error {
			tag, err := q.Exec(ctx, sql, args...)
			if done = tag.RowsAffected() > 0; err != nil || done || after == "" {
				return err
			}
			done, err = hasStatusUnder(ctx, q, c, after)
			return err
		}))
	}
	if err != nil {
		return err
	}
	if !done {
		return idempotency.ErrFenced
	}
	return nil
}

// Purge implements [idempotency.Store.Purge]. One call is one short
// statement: it walks the expires_at index, a bound below each key's expiry
// (see expiredExpr), from the lowest, so about in the order in which the
// keys expired (the keys claimed first first), passes over the few keys
// whose expiry is still to come (those that ran longer than they have
// been past their bound), locks at most limit expired keys (skipping those
// another transaction holds) and deletes them by their physical address.
// A started key whose lease is renewed has no expiry in the past, so it is
// never purged. A limit that is zero or negative purges nothing.
func (s *Store) Purge(ctx context.Context, limit int) (int64, error) {
	if limit <= 0 {
		return 0, nil
	}
	tag, err := s.pool.Exec(ctx, purgeSQL, limit)
	if err != nil {
		return 0, interpretError(err)
	}
	return tag.RowsAffected(), nil
}

// purgeSQL deletes a bounded batch of expired keys: $1 the batch size.
// ctid = ANY (ARRAY(...)) is planned as a TID scan, never a scan of the
// whole table.
const purgeSQL = `
DELETE FROM idempotency_keys
WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM idempotency_keys k
    WHERE k.expires_at < statement_timestamp() AND ` + expiredExpr + `
    ORDER BY k.expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED))`

// hasStatusUnder tells whether c's key has status under c's lock token:
// after a lost statement of c's owner, whether that statement committed,
// since a token names one ownership (a takeover or a new claim takes
// another) and only the owner completes or releases under it. It waits
// (FOR SHARE) for a transaction still writing the row, such as a
// completion whose COMMIT was sent before the connection broke, and reads
// the row as that left it. A key that is gone (purged) has not.
func hasStatusUnder(ctx context.Context, q querier, c idempotency.Claim, status idempotency.Status) (bool, error) {
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
WHERE client_id = $1 AND idempotency_key = $2
FOR SHARE`

// onLiveConn runs f on a connection of the pool that answers a ping, for
// the one retry of a statement whose connection PostgreSQL ended. The
// pool's idle connections may have been ended with it (a restart of the
// server, pg_terminate_backend of every backend), and the pool finds out
// only by using them: each one that fails its ping is closed, which drops
// it from the pool, and the next is tried, up to the pool's size plus one
// (a new connection, then).
func (s *Store) onLiveConn(ctx context.Context, f func(q querier) error) error {
	c, err := s.liveConn(ctx)
	if err != nil {
		return err
	}
	defer c.Release()
	return f(c)
}

// liveConn acquires a connection of the pool that answers a ping (see
// onLiveConn).
func (s *Store) liveConn(ctx context.Context) (*pgxpool.Conn, error) {
	var err error
	for range s.pool.Stat().MaxConns() + 1 {
		var c *pgxpool.Conn
		if c, err = s.pool.Acquire(ctx); err != nil {
			return nil, err
		}
		if err = c.Ping(ctx); err != nil {
			dead := c.Conn().IsClosed()
			c.Release()
			if dead && ctx.Err() == nil {
				continue
			}
			return nil, err
		}
		return c, nil
	}
	return nil, err
}

// interpretError translates an error of pgx into the package's sentinels,
// by SQLSTATE and error type, never by message: errConnLost for a broken
// connection (see connBroken), [idempotency.ErrInvalidText] for text a
// column refuses. Errors it does not know are wrapped with the package
// prefix. errors.Is and errors.As still reach the errors inside: the *pgconn.PgError, the
// context's error, the net.Error.
func interpretError(err error) error {
	if err == nil {
		return nil
	}
	if connBroken(err) {
		return fmt.Errorf("%w: %w", errConnLost, err)
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == characterNotInRepertoire {
		return fmt.Errorf("%w: %w", idempotency.ErrInvalidText, err)
	}
	return fmt.Errorf("pgstore: %w", err)
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

// SQLSTATEs that interpretError and serializationFailure know.
const (
	characterNotInRepertoire = "22021" // invalid UTF-8 or a NUL byte in text
	adminShutdown            = "57P01" // admin_shutdown: pg_terminate_backend, a fast shutdown
	connectionException      = "08"    // the class of connection exceptions
	serializationFailureCode = "40001" // serialization_failure
	deadlockDetected         = "40P01" // deadlock_detected
)

// serializationFailure reports whether err is a serialization failure or
// a deadlock. The store's own statements each run as a transaction of
// their own, in the database's default isolation level: under REPEATABLE
// READ or SERIALIZABLE, one that loses a race for a key's row to another
// (two takeovers of one stale key, say) fails with serialization_failure
// where READ COMMITTED would have it wait and read the row again. It then
// did nothing, and the store runs it again, as PostgreSQL advises, like a
// statement that lost a race under READ COMMITTED (see [Store.Claim]).
func serializationFailure(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == serializationFailureCode || pgErr.Code == deadlockDetected)
}

// errConnLost marks an error of a statement whose connection broke under
// it: PostgreSQL ended it (admin_shutdown, or a connection exception), or
// it failed with no word from PostgreSQL (an EOF, or a network error such
// as a reset or a broken pipe) while the statement was sent or its answer
// read. The connection is gone, and the statement may or may not have
// committed; when pgconn.SafeToRetry(err) is true it was not even sent.
// Errors of a statement whose context is done are not marked, though pgx
// closes the connection under them, and nor are failures to connect (see
// connBroken). [Store] retries Claim, Renew, Release and Complete once on
// another connection, in the ways that are safe for each, unless their
// context is done; other statements return it to the caller.
var errConnLost = errors.New("pgstore: connection lost")
