package pgstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/keysql"
)

// Claims in one transaction (idempotency.TxClaimer): the claim is the
// first statement of the request's transaction, and inserts the key's row,
// started, in it; the completion completes the row and commits it with the
// handler's writes. Until then nothing of the key is visible, and nothing
// waits on its uncommitted row: a duplicate finds the key held by the
// claim's advisory lock, and gets Busy at once (keysql.ClaimTxSQL).

// inTxKey is the key of a claim made in one transaction, as
// keysql.CompleteNewSQL writes it when the transaction ended without it.
type inTxKey struct {
	req     idempotency.ClaimRequest
	created time.Time // the claim's statement_timestamp()
	opID    string
}

// args returns the parameters of keysql.CompleteNewSQL from $8 on.
func (k *inTxKey) args() []any {
	return keysql.CompleteNewArgs(k.req, k.created, k.opID)
}

var _ idempotency.TxClaimer = (*Store)(nil)

// ClaimInTx implements [idempotency.TxClaimer.ClaimInTx] with
// keysql.ClaimTxSQL, sent with the BEGIN of the request's transaction, and
// keysql.ClaimSQL, in a commit of its own, for a key that it could not
// claim so (the key has a row, or another transaction holds it) and for a
// request whose first-sent check is stale. A retry (keysql.Resent) reads
// its key's row first (keysql.ClaimPeekSQL), outside any transaction, and
// a replay or a duplicate ends there. When the connection broke under a
// claim, it runs it once more as Claim does.
func (s *Store) ClaimInTx(ctx context.Context, req idempotency.ClaimRequest) (idempotency.ClaimResult, error) {
	if err := keysql.CheckClaim(req); err != nil {
		return idempotency.ClaimResult{}, err
	}
	if res, ok, err := s.peek(ctx, req); err != nil || ok {
		return res, err // a retry's replay or duplicate: one round trip
	}
	if !req.FirstSent.Stale { // a stale request must not insert the key
		if res, ok, err := s.claimInTx(ctx, req); err != nil || ok {
			return res, err
		}
	}
	return s.claimLoop(ctx, keysql.ClaimSQL, req)
}

// claimInTx claims req's key in one transaction (keysql.ClaimTxSQL, sent
// with the BEGIN in one round trip). When it claimed the key, the
// transaction stays open on its connection, as the unit of work that Begin
// returns. Otherwise it reads the key's row and rolls the transaction back
// (a second round trip), and returns the outcome: a key that has a row, or
// is held, as keysql.ClaimReadSQL reads it; ok is false when the key's row
// can be renewed, or went meanwhile, which it leaves to the caller's claim
// in a commit of its own. When the
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
	u := &unit{store: s, conn: conn}
	u.claim.Token, u.claim.OperationID = keysql.NewToken(), req.OperationID()
	claimed := false
	var created time.Time
	args := keysql.ClaimTxArgs(req, u.claim.OperationID, u.claim.Token)
	u.tx, err = beginOn(ctx, conn, keysql.ClaimTxSQL, args, func(br pgx.BatchResults) error {
		rows, err := br.Query()
		if err != nil {
			return err
		}
		if rows.Next() { // no row: the key has one, or is held
			claimed = rows.Scan(s.claimTxPlans.into(&created, &u.xid)) == nil
		}
		rows.Close()
		return rows.Err()
	})
	if err == nil && claimed {
		u.claim.ClientID, u.claim.Key, u.claim.OneTransaction = req.ClientID, req.Key, true
		u.inTx = &inTxKey{req: req, created: created, opID: u.claim.OperationID}
		s.units.Add(u.claim, u, false)
		return idempotency.ClaimResult{Outcome: idempotency.Claimed, Claim: u.claim}, true, nil
	}
	var row keysql.ClaimRow
	found := false
	if pc := conn.Conn().PgConn(); !pc.IsClosed() && !pc.IsBusy() && pc.TxStatus() != 'I' {
		// Nothing to keep: end the transaction (and drop the connection
		// if that fails). A key that has a row, or is held, is read
		// before, in the same round trip, as a claim in a commit of its
		// own reads it (keysql.ClaimReadSQL).
		b := &pgx.Batch{}
		if err == nil {
			b.Queue(keysql.ClaimReadSQL, keysql.ClaimArgs(req)...)
		}
		b.Queue("ROLLBACK")
		br := conn.SendBatch(context.WithoutCancel(ctx), b)
		var rerr error
		if err == nil {
			row, found, rerr = scanClaim(br.Query())
		}
		if _, xerr := br.Exec(); rerr == nil {
			rerr = xerr
		}
		if cerr := br.Close(); rerr == nil {
			rerr = cerr
		}
		if rerr != nil {
			found = false
			conn.Conn().PgConn().Close(context.WithoutCancel(ctx))
		}
	}
	conn.Release()
	if err != nil && !serializationFailure(err) { // a key committed since the snapshot fails it so
		return none, false, interpretError(err)
	}
	if !found || row.Lost {
		return none, false, nil // the caller claims in a commit of its own
	}
	res, err := row.Result(req)
	return res, err == nil, err
}

// errInTxOver is the error of every statement of a unit of work begun for a
// claim in one transaction whose transaction has ended.
var errInTxOver = fmt.Errorf("pgstore: the claim's transaction is over: %w", idempotency.ErrFenced)

// beginInTx returns the unit of work of c, a claim made in one
// transaction: the one its claim opened, the first time; later, or once it
// ended, one that owns nothing, whose statements fail and whose Complete
// returns ErrFenced.
func (s *Store) beginInTx(c idempotency.Claim) *unit {
	if u, ok := s.units.Open(c); ok {
		return u
	}
	return &unit{store: s, claim: c, inTx: &inTxKey{}, err: errInTxOver}
}
