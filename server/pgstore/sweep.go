package pgstore

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/server/idempotency"
)

// abandonedSQL lists at most $2 keys abandoned with a grace of $1
// microseconds, those abandoned first first. Every abandoned key was
// renewed last at least the grace ago (a release comes after the last
// renewal), so PostgreSQL walks idempotency_keys_open_idx, the index of
// the keys that are not completed, by locked_at, and stops there.
const abandonedSQL = `
SELECT ` + infoColumns + `, NULL::bytea
FROM idempotency_keys k
WHERE k.status <> 'completed' AND k.locked_at <= statement_timestamp() - $1 * interval '1 microsecond'
    AND ` + abandonedExpr + `
ORDER BY k.locked_at, k.client_id, k.idempotency_key
LIMIT $2`

// Abandoned implements [idempotency.Sweepable.Abandoned] in one statement.
func (s *Store) Abandoned(ctx context.Context, grace time.Duration, limit int) ([]idempotency.KeyInfo, error) {
	if limit <= 0 {
		return nil, nil
	}
	rows, _ := s.pool.Query(ctx, abandonedSQL, micros(max(grace, 0)), limit)
	ks, err := pgx.CollectRows(rows, scanInfo)
	return ks, interpretError(err)
}

// adoptKeySQL takes over the key ($2 client, $3 key) that was found with
// token $4 and status $6, if it is still abandoned with a grace of $1
// microseconds: started under a new token, with a lease of $5
// microseconds from now (0: never runs out) and its retention. Its WHERE
// is checked again on the newest row version when another transaction
// (a retry's claim, another sweeper) changed the row first, so one of
// them wins.
const adoptKeySQL = `
UPDATE idempotency_keys k SET
    status = 'started',
    release_rejected = false,
    lock_token = nextval('idempotency_lock_tokens'),
    locked_at = statement_timestamp(),
    lease_us = $5,
    expires_at = CASE WHEN $5::bigint > 0 AND k.retention_us > 0
        THEN statement_timestamp() + k.retention_us * interval '1 microsecond' END
WHERE k.client_id = $2 AND k.idempotency_key = $3 AND k.lock_token = $4 AND k.status = $6
    AND ` + abandonedExpr + `
RETURNING k.lock_token, k.operation_id::text`

// Adopt implements [idempotency.Sweepable.Adopt] in one statement. It is
// not run again when its connection breaks: a takeover that committed with
// its answer lost leaves the key started under a token nobody holds, to be
// found again once that lease ran out and the grace passed.
func (s *Store) Adopt(ctx context.Context, k idempotency.KeyInfo, grace, lease time.Duration) (idempotency.Claim, error) {
	c := idempotency.Claim{ClientID: k.ClientID, Key: k.Key}
	err := s.pool.QueryRow(ctx, adoptKeySQL, micros(max(grace, 0)), k.ClientID, k.Key, k.Token, micros(lease), string(k.Status)).
		Scan(&c.Token, &c.OperationID)
	if errors.Is(err, pgx.ErrNoRows) {
		return idempotency.Claim{}, idempotency.ErrFenced
	}
	if err != nil {
		return idempotency.Claim{}, interpretError(err)
	}
	return c, nil
}
