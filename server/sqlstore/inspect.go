package sqlstore

import (
	"context"
	"database/sql"
	"errors"
	"time"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/keysql"
)

// The Store is an [idempotency.Inspector] and [idempotency.Sweepable], on
// pgstore's statements: what it reports and does is pgstore's.
var (
	_ idempotency.Inspector = (*Store)(nil)
	_ idempotency.Sweepable = (*Store)(nil)
)

// infoRows reads the rows of an inspector's statement (see
// keysql.InfoRow) and closes them.
func infoRows(rows *sql.Rows, err error) ([]idempotency.KeyInfo, error) {
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var ks []idempotency.KeyInfo
	for rows.Next() {
		var r keysql.InfoRow
		if err := rows.Scan(r.Dests(header{&r.RespHeader})...); err != nil {
			return nil, err
		}
		ks = append(ks, r.KeyInfo())
	}
	return ks, rows.Err()
}

// Lookup implements [idempotency.Inspector.Lookup] in one statement. A
// client or key that is not valid text names no key.
func (s *Store) Lookup(ctx context.Context, clientID, key string, body bool) (idempotency.KeyInfo, error) {
	if keysql.CheckText(clientID, key) != nil {
		return idempotency.KeyInfo{}, idempotency.ErrKeyNotFound
	}
	ks, err := infoRows(s.db.QueryContext(ctx, keysql.LookupSQL, clientID, key, body))
	switch {
	case err != nil:
		return idempotency.KeyInfo{}, interpretError(err)
	case len(ks) == 0:
		return idempotency.KeyInfo{}, idempotency.ErrKeyNotFound
	}
	return ks[0], nil
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
	ks, err := infoRows(s.db.QueryContext(ctx, keysql.ListSQL, args...))
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
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return was, interpretError(err)
	}
	defer tx.Rollback() //nolint:errcheck // after Commit, a no-op
	err = func() error {
		ks, err := infoRows(tx.QueryContext(ctx, keysql.ActSQL, clientID, key))
		if err != nil {
			return err
		}
		if len(ks) > 0 {
			was = ks[0]
		}
		query, err := a.Plan(was, len(ks) > 0, running)
		if err != nil || query == "" {
			return err
		}
		_, err = tx.ExecContext(ctx, query, clientID, key)
		return err
	}()
	if err == nil {
		err = tx.Commit()
	}
	return keysql.Outcome(was, err, interpretError)
}

// Stats implements [idempotency.Inspector.Stats] in one statement, over
// the index of [CreateOpenKeysIndex]: without it, it returns
// [ErrNoOpenKeysIndex].
func (s *Store) Stats(ctx context.Context) (idempotency.KeyStats, error) {
	if err := s.needOpenIndex(ctx); err != nil {
		return idempotency.KeyStats{}, err
	}
	var r keysql.StatsRow
	err := s.db.QueryRowContext(ctx, keysql.StatsSQL).Scan(r.Dests()...)
	return r.KeyStats(), interpretError(err)
}

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
	ks, err := infoRows(s.db.QueryContext(ctx, keysql.AbandonedSQL, keysql.Micros(max(grace, 0)), limit))
	return ks, interpretError(err)
}

// Adopt implements [idempotency.Sweepable.Adopt] in one statement. As
// pgstore's, it is not run again when its connection breaks.
func (s *Store) Adopt(ctx context.Context, k idempotency.KeyInfo, grace, lease time.Duration) (idempotency.Claim, error) {
	c := idempotency.Claim{ClientID: k.ClientID, Key: k.Key}
	err := s.db.QueryRowContext(ctx, keysql.AdoptKeySQL, keysql.AdoptArgs(k, grace, lease)...).Scan(&c.Token, &c.OperationID)
	if errors.Is(err, sql.ErrNoRows) {
		return idempotency.Claim{}, idempotency.ErrFenced
	}
	if err != nil {
		return idempotency.Claim{}, interpretError(err)
	}
	return c, nil
}
