package pgstore

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/keysql"
)

// Abandoned implements [idempotency.Sweepable.Abandoned] in one statement,
// over the index of [CreateOpenKeysIndex]: without it, it returns
// [ErrNoOpenKeysIndex].
func (s *Store) Abandoned(ctx context.Context, grace time.Duration, limit int) ([]idempotency.KeyInfo, error) {
	if limit <= 0 {
		return nil, nil
	}
	if err := s.needOpenIndex(ctx); err != nil {
		return nil, err
	}
	rows, _ := s.pool.Query(ctx, keysql.AbandonedSQL, keysql.Micros(max(grace, 0)), limit)
	ks, err := pgx.CollectRows(rows, scanInfo)
	return ks, interpretError(err)
}

// Adopt implements [idempotency.Sweepable.Adopt] in one statement. It is
// not run again when its connection breaks: a takeover that committed with
// its answer lost leaves the key started under a token nobody holds, to be
// found again once that lease ran out and the grace passed.
func (s *Store) Adopt(ctx context.Context, k idempotency.KeyInfo, grace, lease time.Duration) (idempotency.Claim, error) {
	c := idempotency.Claim{ClientID: k.ClientID, Key: k.Key}
	err := s.pool.QueryRow(ctx, keysql.AdoptKeySQL, keysql.AdoptArgs(k, grace, lease)...).Scan(&c.Token, &c.OperationID)
	if errors.Is(err, pgx.ErrNoRows) {
		return idempotency.Claim{}, idempotency.ErrFenced
	}
	if err != nil {
		return idempotency.Claim{}, interpretError(err)
	}
	return c, nil
}
