package keysql

import (
	"encoding/json"
	"time"

	"github.com/idemkit/idem/server/idempotency"
)

// CompleteNewArgs returns the parameters of CompleteNewSQL from $8 on: the
// request of a claim made in one transaction at created, with operation
// opID.
func CompleteNewArgs(req idempotency.ClaimRequest, created time.Time, opID string) []any {
	return []any{req.Method, req.Path, req.Fingerprint, opID, created,
		Micros(req.LockTimeout), Micros(req.Retention)}
}

// TxIDSQL reads the ID of the transaction it runs in, sent with its BEGIN:
// the store checks at the end that the handler's transaction is still
// that one (the completion's own check, TxGuardSQL, TxStatusSQL). It
// assigns the ID at once, which the completion's write would do anyway. A
// claim in one transaction reads it with the claim instead (ClaimTxSQL).
//
// Its second column tells whether the transaction keeps one snapshot to
// its end (REPEATABLE READ or SERIALIZABLE), as the database began it: at
// the session's default_transaction_isolation, which the stores leave to
// the service. As the transaction's first statement it takes that
// snapshot, after which its level can no longer change.
const TxIDSQL = `SELECT pg_current_xact_id()::text AS xid,
    current_setting('transaction_isolation') IN ('repeatable read', 'serializable') AS snapshot`

// TxGuardSQL fails with TxChangedCode unless it runs in the transaction
// whose ID is $1 (TxIDSQL): sent before a ROLLBACK, it tells a transaction
// the handler ended and replaced (COMMIT AND CHAIN) from the one begun.
const TxGuardSQL = `SELECT ` + txIsExpr1

// txIsExpr1 and txIsExpr8 are 1 in the transaction whose ID
// is $1 or $8 (TxIDSQL); in any other they fail with
// numeric_value_out_of_range (TxChangedCode), which no other part of a
// completion raises. An expression rather than a statement of its own, so
// that the check costs the completion no statement.
const (
	txIsExpr1 = `((CASE WHEN pg_current_xact_id() = $1::xid8 THEN 0 ELSE 2147483647 END) + 1)`
	txIsExpr8 = `((CASE WHEN pg_current_xact_id() = $8::xid8 THEN 0 ELSE 2147483647 END) + 1)`
)

// TxChangedCode is the SQLSTATE of a completion in the handler's
// transaction (CompleteInTxSQL), or of TxGuardSQL, run
// in another transaction than the one whose ID it was given: the handler
// ended that one.
const TxChangedCode = "22003"

// TxStatusSQL tells whether the transaction whose ID is $1 (TxIDSQL)
// committed, aborted or is in progress; NULL once it is too old to tell.
const TxStatusSQL = `SELECT pg_xact_status($1::xid8)`

// CompleteSQL completes a key its claim still owns ($1 client, $2 key, $3
// token) with the response ($4 status, $5 content type, $6 headers, $7
// body); the key expires its retention from now (see finishedSetExpr).
// It updates no row when the claim was fenced.
const CompleteSQL = `
UPDATE idempotency_keys SET
    status = 'completed',
    response_status = $4,
    response_content_type = $5,
    response_headers = $6::jsonb,
    response_body = $7,
    ` + finishedSetExpr + `
WHERE client_id = $1 AND idempotency_key = $2 AND lock_token = $3 AND status = 'started'`

// CompleteInTxSQL is CompleteSQL as the last statement of the handler's
// transaction, sent in one pipeline with its COMMIT, with $8 the ID of the
// transaction the handler was given (TxIDSQL). It fails with
// division_by_zero when it completed nothing (the claim was fenced), and
// first with TxChangedCode when it runs in another transaction (the
// handler ended that one): either error makes PostgreSQL skip the COMMIT
// queued behind it, so the handler's writes are never committed without
// the key's outcome. A fenced completion is the only way this statement
// divides by zero. The count is a scalar subquery, evaluated after the
// check of the transaction to its left: in another transaction the
// statement fails with TxChangedCode before its UPDATE runs, and so
// before the UPDATE could fail otherwise (a serialization failure, a
// lock timeout), which the store would not read as the handler's end.
// (The query's own aggregate, 7k instructions cheaper, runs the UPDATE
// first.)
const CompleteInTxSQL = `
WITH done AS (` + CompleteSQL + `
    RETURNING 1)
SELECT ` + txIsExpr8 + ` * 0 + 1 / (SELECT count(*)::integer FROM done)`

// DivisionByZero is the SQLSTATE of a fenced CompleteInTxSQL.
const DivisionByZero = "22012"

// ClaimTxSQL is the claim of a key in one transaction, sent with the BEGIN
// of the transaction the key's request runs in, for a request whose
// first-sent check is not stale (which must not insert the key): a plain
// insert of the key's row, started and without a lease, in the claiming
// transaction, while that holds the key's transaction-level advisory lock
// (keyLockExpr), taken exclusive and without waiting. Parameters: $1 to
// $5 as ClaimSQL's, $6 the retention in microseconds, $7 the operation ID,
// $8 the token (ClaimTxArgs). It returns the time of the claim and the
// transaction's ID, which the completion checks (no TxIDSQL of its own);
// or no row, when another transaction holds the lock
// (it claimed the key in one transaction and has not ended) or the key has
// a row: the caller rolls back and claims in a commit of its own
// (ClaimSQL), which tells the two apart. Under REPEATABLE READ or
// SERIALIZABLE a row committed since the statement's snapshot fails it
// with a serialization failure instead, which the caller reads the same
// way. The completion is CompleteInTxSQL, as in a transaction of a claim
// in a commit of its own.
//
// The lock keeps everyone off the uncommitted row, which they would
// otherwise wait on: a duplicate, or a claim in a commit of its own, tries
// the lock first and is Busy at once. The row holds the key when the lock
// no longer can: a handler that ends the transaction itself (a COMMIT)
// commits the row with its writes, started and without a lease, so that
// no claim ever takes it over; the store then fails it closed (completes
// it with idempotency.UnitEndedResponse). A handler that rolls back takes
// the row with it, and nothing of the request is left. A hash that two
// keys share (one in 2^64 for two keys at once) makes one of them Busy
// until the other ends, as if it were a duplicate.
//
// expires_at is now plus the retention, as for any claim
// (claimedExpiryExpr; this one has no lease): a bound below the key's
// expiry once it completes (see expiredExpr), which the completion leaves
// as it is. A started row without a lease never expires, whatever its
// expires_at.
const ClaimTxSQL = `
INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path,
    request_hash, status, operation_id, lock_token, created_at, locked_at,
    lease_us, retention_us, expires_at)
SELECT $1::text, $2::text, $3::text, $4::text, $5::bytea, 'started', $7::uuid, $8::bigint,
    statement_timestamp(), statement_timestamp(), 0, $6::bigint,
    CASE WHEN $6::bigint > 0 THEN statement_timestamp() + $6::bigint * interval '1 microsecond' END
WHERE pg_try_advisory_xact_lock(` + keyLockExpr + `)
ON CONFLICT (client_id, idempotency_key) DO NOTHING
RETURNING created_at, pg_current_xact_id()::text`

// ClaimTxArgs returns the parameters of ClaimTxSQL for req, with the
// operation ID opID (req.OperationID()) and token (NewToken).
func ClaimTxArgs(req idempotency.ClaimRequest, opID string, token int64) []any {
	return []any{req.ClientID, req.Key, req.Method, req.Path, req.Fingerprint,
		Micros(req.Retention), opID, token}
}

// keyLockExpr is the advisory lock of a key ($1 client, $2 key) claimed in
// one transaction: a 64-bit hash of the key, the client and the key table
// (its OID, so that key tables in other schemas of the database do not
// share locks).
const keyLockExpr = `hashtextextended($2, hashtextextended($1, 'idempotency_keys'::regclass::oid::bigint))`

// WaitKeyLockSQL waits for the advisory lock of a key ($1 client, $2 key)
// claimed in one transaction, which that transaction holds until it ends,
// and then holds it to the end of its own (see pgstore's commit of such a
// claim on a connection that broke).
const WaitKeyLockSQL = `SELECT pg_advisory_xact_lock(` + keyLockExpr + `)`

// LostCommitWait bounds a store's wait (WaitKeyLockSQL) for the end of a
// transaction in one transaction whose COMMIT failed with its outcome
// unknown, before it reads whether the key committed.
const LostCommitWait = 30 * time.Second

// CompleteNewSQL completes the key of a claim made in one transaction
// whose transaction ended without the completion: $1 client, $2 key, $3
// token, $4 to $7 the response as in CompleteSQL, then the claim's request
// ($8 method, $9 path, $10 fingerprint, $11 operation ID, $12 time of the
// claim, $13 lease and $14 retention in microseconds). The key's row is
// gone with a transaction that rolled back, and is inserted, completed;
// one the handler committed, started under $3, is completed. A row of
// another claim (one that took the key since the row was rolled back) is
// left as it is: the statement then changes nothing, and the claim was
// fenced. The key finished now: it expires its retention from now (see
// finishedSetExpr; a row inserted has the claim's bound, claimedExpiryExpr,
// computed from now).
//
// It never waits on another claim in one transaction, which may run for
// as long as its handler does: one that took the key since the row was
// rolled back holds the key's advisory lock (keyLockExpr) over its
// uncommitted row, which the insert would wait on. The statement then
// inserts nothing, tried shared, as ClaimInsertSQL does, and the claim
// was fenced; unless the row the handler committed is there, which no
// other claim can then have inserted.
const CompleteNewSQL = `
INSERT INTO idempotency_keys AS k (client_id, idempotency_key, lock_token, status,
    response_status, response_content_type, response_headers, response_body,
    request_method, request_path, request_hash, operation_id,
    created_at, locked_at, lease_us, retention_us, expires_at)
SELECT $1::text, $2::text, $3::bigint, 'completed', $4::integer, $5::text, $6::jsonb, $7::bytea, $8::text, $9::text, $10::bytea, $11::uuid,
    $12::timestamptz, statement_timestamp(), $13::bigint, $14::bigint,
    CASE WHEN $14::bigint > 0 THEN statement_timestamp() + $14::bigint * interval '1 microsecond' END
WHERE EXISTS (SELECT FROM idempotency_keys o
        WHERE o.client_id = $1 AND o.idempotency_key = $2 AND o.lock_token = $3 AND o.status = 'started')
    OR pg_try_advisory_xact_lock_shared(` + keyLockExpr + `)
ON CONFLICT (client_id, idempotency_key) DO UPDATE SET
    status = 'completed',
    response_status = EXCLUDED.response_status,
    response_content_type = EXCLUDED.response_content_type,
    response_headers = EXCLUDED.response_headers,
    response_body = EXCLUDED.response_body,
    locked_at = statement_timestamp()
WHERE k.lock_token = EXCLUDED.lock_token AND k.status = 'started'`

// IsFence reports whether an error of SQLSTATE code, raised by query
// itself, is the fence of a completion sent with its COMMIT: the division
// by zero of CompleteInTxSQL. The caller tells the statement's own error
// from the COMMIT's behind it: a deferred constraint of the handler's own
// tables fails the COMMIT with any SQLSTATE, and is no fence.
func IsFence(query, code string) bool {
	return query == CompleteInTxSQL && code == DivisionByZero
}

// HeaderArg is the parameter of the response headers ($6 of CompleteSQL
// and CompleteNewSQL, cast to jsonb there): their JSON as text, or SQL
// NULL when there are none. Text encodes in every driver and every pgx
// query mode (pgx's exec and simple_protocol modes cannot encode a map,
// whose type they do not ask PostgreSQL for; lib/pq would send a []byte as
// bytea).
func HeaderArg(m map[string]string) (any, error) {
	if len(m) == 0 {
		return nil, nil
	}
	b, err := json.Marshal(m)
	if err != nil {
		return nil, err
	}
	return string(b), nil
}
