package sqlstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/keysql"
)

// Claims in one transaction (idempotency.TxClaimer), as
// pgstore makes them (see pgstore's package documentation): the claim is
// keysql.ClaimTxSQL, the first statement of the request's transaction,
// which holds the key with a transaction-level advisory lock taken without
// waiting and inserts its row, started, in the transaction; the
// completion completes the row and commits it with the handler's rows.
// database/sql sends the BEGIN in a round trip of its own, and the
// completion before the COMMIT.

// errInTxOver is the error of every statement of a unit of work begun for
// a claim in one transaction whose transaction has ended.
var errInTxOver = fmt.Errorf("sqlstore: the claim's transaction is over: %w", idempotency.ErrFenced)

var _ idempotency.TxClaimer = (*Store)(nil)

// ClaimInTx implements [idempotency.TxClaimer.ClaimInTx] with
// keysql.ClaimTxSQL, the first statement of the request's transaction
// after its BEGIN, and keysql.ClaimSQL, in a commit of its own, for a key
// that it could not claim so (the key has a row, or another transaction
// holds it) and for a request whose first-sent check is stale.
func (s *Store) ClaimInTx(ctx context.Context, req idempotency.ClaimRequest) (idempotency.ClaimResult, error) {
	if err := keysql.CheckClaim(req); err != nil {
		return idempotency.ClaimResult{}, err
	}
	if err := s.prepareAll(ctx); err != nil {
		return idempotency.ClaimResult{}, interpretError(err)
	}
	if res, ok, err := s.peek(ctx, req); err != nil || ok {
		return res, err
	}
	if !req.FirstSent.Stale { // a stale request must not insert the key
		if res, ok, err := s.claimInTx(ctx, req); err != nil || ok {
			return res, err
		}
	}
	return s.claimLoop(ctx, keysql.ClaimSQL, req)
}

// claimInTx claims req's key in one transaction. When it claimed the key,
// the transaction stays open on its connection, as the unit of work that
// Begin returns. Otherwise it rolls the transaction back, and ok is false:
// the caller claims in a commit of its own. When the connection broke
// under the claim, it runs it once more: nothing of it was committed.
func (s *Store) claimInTx(ctx context.Context, req idempotency.ClaimRequest) (res idempotency.ClaimResult, ok bool, err error) {
	for retried := false; ; retried = true {
		res, ok, err = s.claimInTxOnce(ctx, req)
		if !errors.Is(err, errConnLost) || retried || ctx.Err() != nil {
			return res, ok, err
		}
	}
}

// claimInTxOnce is one attempt of claimInTx.
func (s *Store) claimInTxOnce(ctx context.Context, req idempotency.ClaimRequest) (idempotency.ClaimResult, bool, error) {
	var none idempotency.ClaimResult
	u := &unit{store: s}
	if err := u.beginLocked(ctx); err != nil {
		return none, false, err
	}
	var created time.Time
	u.claim.Token, u.claim.OperationID = keysql.NewToken(), req.OperationID()
	args := keysql.ClaimTxArgs(req, u.claim.OperationID, u.claim.Token)
	err := on{s, u.tx}.QueryRowContext(ctx, keysql.ClaimTxSQL, args...).Scan(&created, &u.xid)
	if err == nil {
		u.claim.ClientID, u.claim.Key, u.claim.OneTransaction = req.ClientID, req.Key, true
		u.inTx = keysql.CompleteNewArgs(req, created, u.claim.OperationID)
		s.units.Add(u.claim, u, false)
		return idempotency.ClaimResult{Outcome: idempotency.Claimed, Claim: u.claim}, true, nil
	}
	u.rollbackLocked() // nothing to keep
	// No row: the key has one, or is held; or, under REPEATABLE READ or
	// SERIALIZABLE, a key committed since the snapshot failed it.
	if errors.Is(err, sql.ErrNoRows) || retryable(err) {
		return none, false, nil
	}
	return none, false, interpretError(err)
}

// beginInTx returns the unit of work of c, a claim made in one
// transaction: the one its claim opened, the first time; later, or once it
// ended, one that owns nothing, whose statements fail and whose Complete
// returns ErrFenced.
func (s *Store) beginInTx(c idempotency.Claim) *unit {
	if u, ok := s.units.Open(c); ok {
		return u
	}
	return &unit{store: s, claim: c, inTx: []any{}, err: errInTxOver}
}
