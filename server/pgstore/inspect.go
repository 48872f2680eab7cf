package pgstore

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/server/idempotency"
)

// The Store is an [idempotency.Inspector] and [idempotency.Sweepable].
var (
	_ idempotency.Inspector = (*Store)(nil)
	_ idempotency.Sweepable = (*Store)(nil)
)

// More expressions over a key row k (see staleExpr).
const (
	// finishedExpr is when k was completed or released; NULL while
	// started. This package sets locked_at when a key finishes (see
	// finishedSetExpr); a replica of the previous release set expires_at
	// to the retention after it finished and left locked_at at the last
	// renewal; the later of the two is the time it finished, whichever
	// wrote the row (expires_at less the retention is never later than
	// the finish for a row this package finished).
	finishedExpr = `(CASE WHEN k.status <> 'started'
        THEN greatest(k.locked_at, k.expires_at - k.retention_us * interval '1 microsecond') END)`
	// releasedAtExpr is when a released k was released, or its last
	// renewal before that when the release is not stored.
	releasedAtExpr = `coalesce(` + finishedExpr + `, k.locked_at)`
	// liveExpr: k does not count as absent.
	liveExpr = `(` + expiredExpr + ` IS NOT TRUE)`
	// abandonedExpr: k is abandoned (see [idempotency.Sweepable]) with
	// the grace in microseconds of parameter $1.
	abandonedExpr = `(` + liveExpr + ` AND (
        (` + staleExpr + ` AND k.locked_at <= statement_timestamp() - (k.lease_us + $1) * interval '1 microsecond')
        OR (k.status = 'released' AND NOT k.release_rejected
            AND ` + releasedAtExpr + ` <= statement_timestamp() - $1 * interval '1 microsecond')))`
)

// infoColumns are the columns of a KeyInfo, scanned by scanInfo, but for
// the response's body, which each statement adds (or NULL) as the last
// column.
const infoColumns = `k.client_id, k.idempotency_key, k.request_method, k.request_path, k.status, k.release_rejected,
    k.operation_id::text, k.lock_token, k.fingerprint_version, k.created_at, k.locked_at, ` + finishedExpr + `,
    ` + expiryExpr + `, k.lease_us, k.retention_us, (extract(epoch FROM statement_timestamp() - k.locked_at) * 1000000)::bigint,
    ` + staleExpr + `, ` + expiredExpr + ` IS TRUE,
    k.response_status, k.response_content_type, k.response_headers`

// scanInfo scans a row of infoColumns and a body.
func scanInfo(row pgx.CollectableRow) (idempotency.KeyInfo, error) {
	var (
		k                     idempotency.KeyInfo
		status                string
		rejected              bool
		version               int32
		finished, expires     *time.Time
		lease, retention, age int64
		respStatus            *int32
		respContentType       *string
		respHeader            map[string]string
		respBody              []byte
	)
	err := row.Scan(&k.ClientID, &k.Key, &k.Method, &k.Path, &status, &rejected,
		&k.OperationID, &k.Token, &version, &k.CreatedAt, &k.LockedAt, &finished,
		&expires, &lease, &retention, &age,
		&k.Lapsed, &k.Expired,
		&respStatus, &respContentType, &respHeader, &respBody)
	if err != nil {
		return k, err
	}
	k.Status = idempotency.Status(status)
	if k.Status == idempotency.StatusReleased && rejected {
		k.ReleaseKind = idempotency.ReleaseRejected
	}
	k.FingerprintVersion = int(version)
	if finished != nil {
		k.FinishedAt = *finished
	}
	if expires != nil {
		k.ExpiresAt = *expires
	}
	k.Lease = time.Duration(lease) * time.Microsecond
	k.Retention = time.Duration(retention) * time.Microsecond
	k.LeaseAge = time.Duration(age) * time.Microsecond
	if respStatus != nil {
		k.Response = &idempotency.StoredResponse{Status: int(*respStatus), Header: respHeader, Body: respBody}
		if respContentType != nil {
			k.Response.ContentType = *respContentType
		}
	}
	return k, nil
}

// lookupSQL reads one key ($1 client, $2 key), its body if $3.
const lookupSQL = `
SELECT ` + infoColumns + `, CASE WHEN $3 THEN k.response_body END
FROM idempotency_keys k
WHERE k.client_id = $1 AND k.idempotency_key = $2`

// Lookup implements [idempotency.Inspector.Lookup] in one statement. A
// client or key that is not valid text names no key.
func (s *Store) Lookup(ctx context.Context, clientID, key string, body bool) (idempotency.KeyInfo, error) {
	if checkText(clientID, key) != nil {
		return idempotency.KeyInfo{}, idempotency.ErrKeyNotFound
	}
	rows, _ := s.pool.Query(ctx, lookupSQL, clientID, key, body)
	k, err := pgx.CollectExactlyOneRow(rows, scanInfo)
	if errors.Is(err, pgx.ErrNoRows) {
		return k, idempotency.ErrKeyNotFound
	}
	return k, interpretError(err)
}

// listSQL lists the live keys of status $1 (started or released), of
// client $2 (all if empty), older than $3 microseconds (started: by
// created_at, released: by their release), oldest first, at most $4. The
// status <> 'completed' lets PostgreSQL walk idempotency_keys_open_idx,
// which holds only the keys that are not completed.
const listSQL = `
SELECT ` + infoColumns + `, NULL::bytea
FROM idempotency_keys k
WHERE k.status <> 'completed' AND k.status = $1 AND ($2 = '' OR k.client_id = $2) AND ` + liveExpr + `
    AND CASE WHEN k.status = 'started' THEN k.created_at ELSE ` + releasedAtExpr + ` END
        <= statement_timestamp() - $3 * interval '1 microsecond'
ORDER BY k.created_at, k.client_id, k.idempotency_key
LIMIT $4`

// List implements [idempotency.Inspector.List] in one statement.
func (s *Store) List(ctx context.Context, f idempotency.ListFilter) ([]idempotency.KeyInfo, error) {
	if (f.Status != idempotency.StatusStarted && f.Status != idempotency.StatusReleased) || checkText(f.ClientID) != nil {
		return nil, nil
	}
	rows, _ := s.pool.Query(ctx, listSQL, string(f.Status), f.ClientID, micros(max(f.OlderThan, 0)), f.EffectiveLimit())
	ks, err := pgx.CollectRows(rows, scanInfo)
	return ks, interpretError(err)
}

// forceReleaseSQL releases a key ($1 client, $2 key) as failed under a
// new token, which fences its owner; it expires its retention from now.
const forceReleaseSQL = `
UPDATE idempotency_keys SET status = 'released', release_rejected = false,
    lock_token = nextval('idempotency_lock_tokens'), ` + finishedSetExpr + `
WHERE client_id = $1 AND idempotency_key = $2`

// ForceRelease implements [idempotency.Inspector.ForceRelease]: in one
// transaction, it locks the key's row, reads it and releases it.
func (s *Store) ForceRelease(ctx context.Context, clientID, key string, running bool) (idempotency.KeyInfo, error) {
	return s.act(ctx, clientID, key, running, func(k idempotency.KeyInfo) (string, error) {
		switch k.Status {
		case idempotency.StatusCompleted:
			return "", idempotency.ErrKeyCompleted
		case idempotency.StatusStarted:
			return forceReleaseSQL, nil
		}
		return "", nil // released already
	})
}

// expireSQL makes a key ($1 client, $2 key) count as absent at once
// (see expiredExpr), under a new token, which fences its owner: it expired
// a millisecond ago, and so did its retention after its last renewal,
// which is moved back for that when needed (a key kept forever is given a
// retention of one microsecond). A started key is released as rejected,
// so that nothing of the rules for started keys keeps it alive.
const expireSQL = `
UPDATE idempotency_keys SET
    status = CASE WHEN status = 'started' THEN 'released' ELSE status END,
    release_rejected = release_rejected OR status = 'started',
    lock_token = nextval('idempotency_lock_tokens'),
    retention_us = greatest(retention_us, 1),
    locked_at = least(locked_at, statement_timestamp() - interval '1 millisecond' - greatest(retention_us, 1) * interval '1 microsecond'),
    expires_at = statement_timestamp() - interval '1 millisecond'
WHERE client_id = $1 AND idempotency_key = $2`

// Expire implements [idempotency.Inspector.Expire]: in one transaction, it
// locks the key's row, reads it and expires it.
func (s *Store) Expire(ctx context.Context, clientID, key string, running bool) (idempotency.KeyInfo, error) {
	return s.act(ctx, clientID, key, running, func(idempotency.KeyInfo) (string, error) {
		return expireSQL, nil
	})
}

// actSQL reads a key ($1 client, $2 key) and locks its row.
const actSQL = `
SELECT ` + infoColumns + `, NULL::bytea
FROM idempotency_keys k
WHERE k.client_id = $1 AND k.idempotency_key = $2
FOR UPDATE`

// act locks and reads the live key of clientID and, unless it is running
// and running is false, runs the statement that change returns for it (""
// for none), all in one transaction. It returns the key as it was.
func (s *Store) act(ctx context.Context, clientID, key string, running bool, change func(idempotency.KeyInfo) (string, error)) (idempotency.KeyInfo, error) {
	var was idempotency.KeyInfo
	if checkText(clientID, key) != nil {
		return was, idempotency.ErrKeyNotFound
	}
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		rows, _ := tx.Query(ctx, actSQL, clientID, key)
		var err error
		switch was, err = pgx.CollectExactlyOneRow(rows, scanInfo); {
		case errors.Is(err, pgx.ErrNoRows) || (err == nil && was.Expired):
			return idempotency.ErrKeyNotFound
		case err != nil:
			return err
		case was.Running() && !running:
			return idempotency.ErrKeyRunning
		}
		sql, err := change(was)
		if err != nil || sql == "" {
			return err
		}
		_, err = tx.Exec(ctx, sql, clientID, key)
		return err
	})
	switch {
	case errors.Is(err, idempotency.ErrKeyNotFound):
		return idempotency.KeyInfo{}, err
	case errors.Is(err, idempotency.ErrKeyRunning), errors.Is(err, idempotency.ErrKeyCompleted):
		return was, err
	}
	return was, interpretError(err)
}

// statsSQL counts the live keys that are not completed; like listSQL, it
// walks idempotency_keys_open_idx.
const statsSQL = `
SELECT count(*) FILTER (WHERE k.status = 'started' AND NOT ` + staleExpr + `),
    coalesce((extract(epoch FROM statement_timestamp() - min(k.created_at)
        FILTER (WHERE k.status = 'started' AND NOT ` + staleExpr + `)) * 1000000)::bigint, 0),
    count(*) FILTER (WHERE ` + staleExpr + `),
    count(*) FILTER (WHERE k.status = 'released' AND NOT k.release_rejected)
FROM idempotency_keys k
WHERE k.status <> 'completed' AND ` + liveExpr

// Stats implements [idempotency.Inspector.Stats] in one statement, whose
// cost grows with the keys that are not completed (running, lapsed or
// released), not with the table.
func (s *Store) Stats(ctx context.Context) (idempotency.KeyStats, error) {
	var st idempotency.KeyStats
	var oldest int64
	err := s.pool.QueryRow(ctx, statsSQL).Scan(&st.Running, &oldest, &st.Lapsed, &st.ReleasedFailed)
	st.OldestRunning = time.Duration(oldest) * time.Microsecond
	return st, interpretError(err)
}
