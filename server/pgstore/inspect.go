package pgstore

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/keysql"
)

// The Store is an [idempotency.Inspector] and [idempotency.Sweepable].
var (
	_ idempotency.Inspector = (*Store)(nil)
	_ idempotency.Sweepable = (*Store)(nil)
)

// scanInfo scans a row of the inspector's statements (keysql.InfoRow).
func scanInfo(row pgx.CollectableRow) (idempotency.KeyInfo, error) {
	var r keysql.InfoRow
	if err := row.Scan(r.Dests(&r.RespHeader)...); err != nil {
		return idempotency.KeyInfo{}, err
	}
	return r.KeyInfo(), nil
}

// Lookup implements [idempotency.Inspector.Lookup] in one statement. A
// client or key that is not valid text names no key.
func (s *Store) Lookup(ctx context.Context, clientID, key string, body bool) (idempotency.KeyInfo, error) {
	if keysql.CheckText(clientID, key) != nil {
		return idempotency.KeyInfo{}, idempotency.ErrKeyNotFound
	}
	rows, _ := s.pool.Query(ctx, keysql.LookupSQL, clientID, key, body)
	k, err := pgx.CollectExactlyOneRow(rows, scanInfo)
	if errors.Is(err, pgx.ErrNoRows) {
		return k, idempotency.ErrKeyNotFound
	}
	return k, interpretError(err)
}

// List implements [idempotency.Inspector.List] in one statement, over the
// index of [CreateOpenKeysIndex]: without it, it returns
// [ErrNoOpenKeysIndex].
func (s *Store) List(ctx context.Context, f idempotency.ListFilter) ([]idempotency.KeyInfo, error) {
	args, ok := keysql.ListArgs(f)
	if !ok {
		return nil, nil
	}
	if err := s.needOpenIndex(ctx); err != nil {
		return nil, err
	}
	rows, _ := s.pool.Query(ctx, keysql.ListSQL, args...)
	ks, err := pgx.CollectRows(rows, scanInfo)
	return ks, interpretError(err)
}

// ForceRelease implements [idempotency.Inspector.ForceRelease]: in one
// transaction, it locks the key's row, reads it and releases it.
func (s *Store) ForceRelease(ctx context.Context, clientID, key string, running bool) (idempotency.KeyInfo, error) {
	return s.act(ctx, clientID, key, running, keysql.ForceRelease)
}

// Expire implements [idempotency.Inspector.Expire]: in one transaction, it
// locks the key's row, reads it and expires it.
func (s *Store) Expire(ctx context.Context, clientID, key string, running bool) (idempotency.KeyInfo, error) {
	return s.act(ctx, clientID, key, running, keysql.Expire)
}

// act locks and reads the key of clientID and runs what a plans for it,
// all in one transaction. It returns the key as it was.
func (s *Store) act(ctx context.Context, clientID, key string, running bool, a keysql.Action) (idempotency.KeyInfo, error) {
	var was idempotency.KeyInfo
	if keysql.CheckText(clientID, key) != nil {
		return was, idempotency.ErrKeyNotFound
	}
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		rows, _ := tx.Query(ctx, keysql.ActSQL, clientID, key)
		var err error
		was, err = pgx.CollectExactlyOneRow(rows, scanInfo)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return err
		}
		sql, err := a.Plan(was, err == nil, running)
		if err != nil || sql == "" {
			return err
		}
		_, err = tx.Exec(ctx, sql, clientID, key)
		return err
	})
	return keysql.Outcome(was, err, interpretError)
}

// Stats implements [idempotency.Inspector.Stats] in one statement over the
// index of [CreateOpenKeysIndex], whose cost grows with the keys that are
// not completed (running, lapsed or released), not with the table; without
// the index, it returns [ErrNoOpenKeysIndex].
func (s *Store) Stats(ctx context.Context) (idempotency.KeyStats, error) {
	if err := s.needOpenIndex(ctx); err != nil {
		return idempotency.KeyStats{}, err
	}
	var r keysql.StatsRow
	err := s.pool.QueryRow(ctx, keysql.StatsSQL).Scan(r.Dests()...)
	return r.KeyStats(), interpretError(err)
}
