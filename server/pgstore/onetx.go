package pgstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/server/idempotency"
)

// Claims in one transaction (idempotency.ClaimRequest.OneTransaction): the
// claim is the first statement of the request's transaction, and writes
// nothing; the completion inserts the key, completed, and commits it with
// the handler's writes. Until then the key has no row, neither committed nor
// uncommitted, so nothing waits on one: a duplicate finds the key held by the
// claim's advisory lock, and gets Busy at once.

// claimTxSQL is the claim of a key in one transaction, sent with the BEGIN
// of the transaction the key's request runs in; the same parameters as
// claimSQL. A key that has a row is read as claimReadSQL reads it (outcome 3,
// or 4, flagged when claimSQL would renew it). A key that has none is held
// with a transaction-level advisory lock, taken without waiting, on a hash
// of the table, the client and the key: outcome 1 with a new token and
// operation ID and the time of the claim, which the completion writes with
// the key (completeNewInTxSQL); or outcome 5 (Busy) when another
// transaction holds the lock, having claimed the key in one transaction and
// not ended. No row is written, so neither a duplicate nor a claim in a
// commit of its own ever waits for the claiming transaction. A request
// whose first-sent check is stale takes no lock: outcome 4 (refusedAbsentRow).
//
// The lock is taken only for a key the statement's snapshot does not have,
// so readers of a committed key do not hold it. A transaction that commits
// the key between that snapshot and the lock leaves the claim believing the
// key absent; the claim's completion then finds the row and is fenced, and
// commits nothing (see completeNewInTxSQL). A hash that two keys share
// (one in 2^64 for two keys at once) makes one of them Busy until the other
// ends, as if it were a duplicate.
const claimTxSQL = `
WITH ` + existingCTE + `, probe AS (
    SELECT CASE WHEN EXISTS (SELECT FROM existing) OR $9::boolean THEN NULL
        ELSE pg_try_advisory_xact_lock(` + keyLockExpr + `) END AS held,
        $3::text AS method, $4::text AS path, $7::bigint AS lease_us, $8::bigint AS retention_us -- unused: typed for the prepared statement
)
SELECT 1, nextval('idempotency_lock_tokens'), gen_random_uuid()::text,
    NULL::text, NULL::text, NULL::bytea, NULL::integer, NULL::text,
    NULL::integer, NULL::text, NULL::jsonb, NULL::bytea, statement_timestamp(), NULL::timestamptz, false
FROM probe WHERE held
UNION ALL
SELECT 5, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, false
FROM probe WHERE NOT held
UNION ALL
` + existingRow + `
UNION ALL
` + refusedAbsentRow

// keyLockExpr is the advisory lock of a key ($1 client, $2 key) claimed in
// one transaction: a 64-bit hash of the key, the client and the key table
// (its OID, so that key tables in other schemas of the database do not
// share locks).
const keyLockExpr = `hashtextextended($2, hashtextextended($1, 'idempotency_keys'::regclass::oid::bigint))`

// completeNewSQL inserts the key of a claim made in one transaction,
// completed: $1 client, $2 key, $3 token, $4 to $7 the response as in
// completeSQL, then the claim's request ($8 method, $9 path, $10
// fingerprint, $11 its version, $12 operation ID, $13 time of the claim,
// $14 lease and $15 retention in microseconds). The key finished now: it
// expires its retention from now. It inserts nothing when the key has a row
// (a claim in a commit of its own, from a route without the mode, took the
// key meanwhile): the claim was fenced.
const completeNewSQL = `
INSERT INTO idempotency_keys (client_id, idempotency_key, lock_token, status,
    response_status, response_content_type, response_headers, response_body,
    request_method, request_path, request_hash, fingerprint_version, operation_id,
    created_at, locked_at, lease_us, retention_us, expires_at)
VALUES ($1, $2, $3, 'completed', $4, $5, $6, $7, $8, $9, $10, $11, $12::uuid, $13, statement_timestamp(), $14, $15,
    CASE WHEN $15::bigint > 0 THEN statement_timestamp() + $15::bigint * interval '1 microsecond' END)
ON CONFLICT (client_id, idempotency_key) DO NOTHING`

// completeNewInTxSQL is completeNewSQL as the last statement of the
// claim's transaction, sent with its COMMIT, failing with division_by_zero
// when it inserted nothing (fenced) as completeInTxSQL does.
const completeNewInTxSQL = `
WITH done AS (` + completeNewSQL + `
    RETURNING 1)
SELECT 1 / (SELECT count(*)::integer FROM done)`

// inTxKey is the key of a claim made in one transaction, as its completion
// writes it.
type inTxKey struct {
	req     idempotency.ClaimRequest
	created time.Time // the claim's statement_timestamp()
	opID    string
}

// args returns the parameters of completeNewSQL from $8 on.
func (k *inTxKey) args() []any {
	return []any{k.req.Method, k.req.Path, k.req.Fingerprint, k.req.FingerprintVersion, k.opID, k.created,
		micros(k.req.LockTimeout), micros(k.req.Retention)}
}

// claimInTx claims req's key in one transaction (claimTxSQL, sent with the
// BEGIN in one round trip). When it claimed the key, the transaction stays
// open on its connection, as the unit of work that Begin returns. Otherwise
// it rolls the transaction back (a second round trip) and returns the
// outcome; ok is false when the key has a row that claimSQL may renew
// (released, expired, stale), which it leaves to the caller. When the
// connection broke under the claim, it runs it once more on a connection
// that answers: nothing of it was committed.
func (s *Store) claimInTx(ctx context.Context, req idempotency.ClaimRequest) (res idempotency.ClaimResult, ok bool, err error) {
	for retried := false; ; retried = true {
		res, ok, err = s.claimInTxOnce(ctx, req, retried)
		if !errors.Is(err, errConnLost) || retried || ctx.Err() != nil {
			return res, ok, err
		}
	}
}

// claimInTxOnce is one attempt of claimInTx, on a connection that answers a
// ping when live is true.
func (s *Store) claimInTxOnce(ctx context.Context, req idempotency.ClaimRequest, live bool) (idempotency.ClaimResult, bool, error) {
	var none idempotency.ClaimResult
	acquire := s.pool.Acquire
	if live {
		acquire = s.liveConn
	}
	conn, err := acquire(ctx)
	if err != nil {
		return none, false, interpretError(err)
	}
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	b.Queue(claimTxSQL, claimArgs(req)...)
	br := conn.SendBatch(ctx, b)
	_, err = br.Exec() // the BEGIN
	var row claimRow
	found := false
	if err == nil {
		row, found, err = scanClaim(br.Query())
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err == nil && !found {
		err = errors.New("the claim returned no row")
	}
	if err == nil && row.outcome == idempotency.Claimed {
		u := &unit{store: s, conn: conn, tx: br.Tx(), inTx: &inTxKey{req: req, created: *row.createdAt, opID: *row.operationID}}
		u.claim = idempotency.Claim{ClientID: req.ClientID, Key: req.Key, Token: *row.token,
			OperationID: *row.operationID, OneTransaction: true}
		s.register(u)
		return idempotency.ClaimResult{Outcome: idempotency.Claimed, Claim: u.claim}, true, nil
	}
	if pc := conn.Conn().PgConn(); !pc.IsClosed() && !pc.IsBusy() && pc.TxStatus() != 'I' {
		// Nothing to keep: end the transaction (and drop the connection
		// if that fails).
		if _, rerr := conn.Exec(context.WithoutCancel(ctx), "ROLLBACK"); rerr != nil {
			conn.Conn().PgConn().Close(context.WithoutCancel(ctx))
		}
	}
	conn.Release()
	if err != nil {
		return none, false, interpretError(err)
	}
	if row.lost {
		return none, false, nil
	}
	return row.result(req), true, nil
}

// register adds u to the units of work that Renew, Release and Begin look
// up by token.
func (s *Store) register(u *unit) {
	s.unitsMu.Lock()
	if s.units == nil {
		s.units = make(map[int64]*unit)
	}
	s.units[u.claim.Token] = u
	s.unitsMu.Unlock()
}

// errInTxOver is the error of every statement of a unit of work begun for a
// claim in one transaction whose transaction has ended.
var errInTxOver = fmt.Errorf("pgstore: the claim's transaction is over: %w", idempotency.ErrFenced)

// beginInTx returns the unit of work of c, a claim made in one
// transaction: the one its claim opened, the first time; later, or once it
// ended, one that owns nothing, whose statements fail and whose Complete
// returns ErrFenced.
func (s *Store) beginInTx(c idempotency.Claim) *unit {
	s.unitsMu.Lock()
	defer s.unitsMu.Unlock()
	if u := s.units[c.Token]; u != nil && u.claim == c && !u.opened {
		u.opened = true
		return u
	}
	return &unit{store: s, claim: c, inTx: &inTxKey{}, err: errInTxOver}
}

// inTxOpen implements Renew for a claim made in one transaction, which has
// no lease: nil while its transaction is open, ErrFenced after.
func (s *Store) inTxOpen(ctx context.Context, c idempotency.Claim) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if s.unitOf(c) == nil {
		return idempotency.ErrFenced
	}
	return nil
}

// releaseInTx implements Release for a claim made in one transaction: it
// rolls back the claim's transaction, key and all, or returns ErrFenced
// once that has ended.
func (s *Store) releaseInTx(ctx context.Context, c idempotency.Claim) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	u := s.unitOf(c)
	if u == nil {
		return idempotency.ErrFenced
	}
	return u.Rollback(ctx)
}

// completeInTx completes the unit of a claim made in one transaction: it
// inserts the key, completed, and commits it with the handler's writes
// (completeNewInTxSQL and COMMIT, one round trip). args are completeNewSQL's
// parameters. A handler whose write failed has nothing to commit: its
// transaction is rolled back, key included, and a stored 4xx outcome is
// inserted alone, as completeSQL stores it alone for a claim in a commit of
// its own. The caller holds u.mu and has checked the response.
func (u *unit) completeInTx(ctx context.Context, status int, args []any) error {
	if u.tx == nil {
		return idempotency.ErrFenced // its transaction ended: the key went with it
	}
	if err := u.checkOpen(); err != nil {
		u.rollbackLocked(ctx)
		return err
	}
	if u.conn.Conn().PgConn().IsBusy() {
		u.rollbackLocked(ctx)
		return fmt.Errorf("pgstore: the handler answered %d but left rows or a batch of its transaction open; nothing was committed", status)
	}
	switch u.conn.Conn().PgConn().TxStatus() {
	case 'T':
		err := u.commitLocked(ctx, completeNewInTxSQL, args)
		if serializationFailure(err) && u.store.takenMeanwhile(ctx, u.claim) {
			// Under REPEATABLE READ or SERIALIZABLE, a row committed after
			// the transaction's snapshot fails the insert this way, not
			// as a conflict.
			return idempotency.ErrFenced
		}
		return err
	case 'E':
		u.rollbackLocked(ctx)
		if status < 400 {
			return fmt.Errorf("pgstore: the handler answered %d but its transaction failed; nothing was committed", status)
		}
		return u.store.ownedUpdate(ctx, u.claim, completeNewSQL, args[3:], idempotency.StatusCompleted)
	default:
		u.rollbackLocked(ctx)
		return fmt.Errorf("pgstore: the handler's transaction is no longer usable (its connection closed); nothing of it was committed")
	}
}

// takenSQL tells whether a key ($1 client, $2 key) has a row under
// another token than $3.
const takenSQL = `
SELECT EXISTS (SELECT FROM idempotency_keys
    WHERE client_id = $1 AND idempotency_key = $2 AND lock_token <> $3)`

// takenMeanwhile reports whether c's key, claimed in one transaction, has
// a row of another claim: one in a commit of its own took the key while
// c's transaction was open. An error reads as not taken.
func (s *Store) takenMeanwhile(ctx context.Context, c idempotency.Claim) bool {
	var taken bool
	err := s.pool.QueryRow(context.WithoutCancel(ctx), takenSQL, c.ClientID, c.Key, c.Token).Scan(&taken)
	return err == nil && taken
}
