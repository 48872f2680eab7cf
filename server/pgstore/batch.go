package server

import (
	"context"
	"encoding/json"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// batchClaimSQL claims new keys, many in one statement: it inserts a
// started row for each key that has none, as claimSQL's inserted branch
// does for one, and returns the rows it inserted. A key that has a row, or
// that stands twice in the batch (the second time), is skipped; its caller
// runs claimSQL. Parameters: parallel arrays of $1 client, $2 key,
// $3 method, $4 path, $5 fingerprint, $6 fingerprint version.
const batchClaimSQL = `
INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path,
    request_hash, fingerprint_version, status, operation_id, lock_token, created_at, locked_at)
SELECT r.client, r.key, r.method, r.path, r.hash, r.version, 'started',
    gen_random_uuid(), nextval('idempotency_lock_tokens'), now(), now()
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[], $6::integer[])
    AS r(client, key, method, path, hash, version)
ON CONFLICT (client_id, idempotency_key) DO NOTHING
RETURNING client_id, idempotency_key, lock_token, operation_id::text`

// batcher gathers the items that arrive while one batch of them is
// running into the next, so that under load one statement and one commit
// serve many requests (see [PostgresStore.BatchClaims] and
// [PostgresStore.BatchCompletions]). A goroutine runs the batches while
// items wait, and ends when none do. Its zero value is ready.
type batcher[T any] struct {
	mu      sync.Mutex
	queue   []T
	running bool // a drain goroutine is running
}

// add queues item for the next batch, and starts a goroutine that runs
// run on the batches unless one is running.
func (b *batcher[T]) add(item T, run func([]T)) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.queue = append(b.queue, item)
	if !b.running {
		b.running = true
		go b.drain(run)
	}
}

// drain runs run on batches of the queued items until there are none.
func (b *batcher[T]) drain(run func([]T)) {
	for {
		b.mu.Lock()
		batch := b.queue
		b.queue = nil
		if len(batch) == 0 {
			b.running = false
			b.mu.Unlock()
			return
		}
		b.mu.Unlock()
		run(batch)
	}
}

// The states of a pendingClaim: its caller waits for it, has left, or has
// been handed its result.
const (
	claimWaiting int32 = iota
	claimAbandoned
	claimDelivered
)

// pendingClaim is one caller's claim in a batch.
type pendingClaim struct {
	req   ClaimRequest
	state atomic.Int32
	done  chan struct{} // closed when the result below is set

	claimed bool // the batch inserted the key's row: claim is the caller's
	claim   Claim
}

// batchClaim tries req in a batch. It returns claimed when the batch inserted
// the key's row; otherwise (the key has a row, or the batch failed) the
// caller claims it the usual way, with claimSQL, which also reports a
// database error. A caller whose ctx ends while it waits leaves at once
// with ctx's error; a key the batch then claims for it is released as
// rejected (nothing was done under it), so it does not stay started until
// the lock timeout.
func (s *PostgresStore) batchClaim(ctx context.Context, req ClaimRequest) (Claim, bool, error) {
	if err := ctx.Err(); err != nil {
		return Claim{}, false, err
	}
	p := &pendingClaim{req: req, done: make(chan struct{})}
	s.claims.add(p, func(batch []*pendingClaim) { s.runClaimBatch(context.Background(), batch) })
	select {
	case <-p.done:
		return p.claim, p.claimed, nil
	case <-ctx.Done():
		if p.state.CompareAndSwap(claimWaiting, claimAbandoned) {
			return Claim{}, false, ctx.Err() // runClaimBatch releases a claim made for p
		}
		<-p.done // handed over just now: the release is the caller's
		if p.claimed {
			_ = s.Release(context.WithoutCancel(ctx), p.claim, ReleaseRejected) // best effort, as for a panic
		}
		return Claim{}, false, ctx.Err()
	}
}

// runClaimBatch runs batchClaimSQL for batch and hands every pending
// claim its result; it releases the keys it claimed for callers that have
// left. On an error every claim is left unclaimed, and each caller claims
// its key with claimSQL, which sees whatever the batch did: a row a lost
// batch did commit is found started, as after a lost claimSQL (see
// [PostgresStore.Claim]).
func (s *PostgresStore) runClaimBatch(ctx context.Context, batch []*pendingClaim) {
	defer func() {
		for _, p := range batch {
			if !p.state.CompareAndSwap(claimWaiting, claimDelivered) && p.claimed {
				_ = s.Release(ctx, p.claim, ReleaseRejected) // its caller has left
			}
			close(p.done)
		}
	}()
	n := len(batch)
	clients, keys, methods, paths := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	hashes, versions := make([][]byte, n), make([]int64, n)
	for i, p := range batch {
		clients[i], keys[i], methods[i], paths[i] = p.req.ClientID, p.req.Key, p.req.Method, p.req.Path
		hashes[i], versions[i] = p.req.Fingerprint, int64(p.req.FingerprintVersion)
	}
	b := &pgx.Batch{}
	if s.AsyncClaims {
		b.Queue(asyncCommitSQL)
	}
	b.Queue(batchClaimSQL, clients, keys, methods, paths, hashes, versions)
	br := s.pool.SendBatch(ctx, b)
	closed := false
	defer func() {
		if !closed {
			br.Close()
		}
	}()
	if s.AsyncClaims {
		if _, err := br.Exec(); err != nil {
			return
		}
	}
	rows, err := br.Query()
	if err != nil {
		return
	}
	byKey := make(map[[2]string]*pendingClaim, n)
	for _, p := range batch {
		k := [2]string{p.req.ClientID, p.req.Key}
		if byKey[k] == nil { // a key twice in a batch: the first one's row
			byKey[k] = p
		}
	}
	claimed := make([]*pendingClaim, 0, n)
	for rows.Next() {
		var c Claim
		if err := rows.Scan(&c.ClientID, &c.Key, &c.Token, &c.OperationID); err != nil {
			break
		}
		if p := byKey[[2]string{c.ClientID, c.Key}]; p != nil {
			p.claim = c
			claimed = append(claimed, p)
		}
	}
	rows.Close()
	if rows.Err() != nil {
		return // not committed, or not known to be: claimSQL decides
	}
	// The batch's implicit transaction commits at its end, after the rows:
	// only the end of the batch says it did. A commit that failed (the
	// connection ended while the commit waited for its WAL flush, say)
	// leaves no row, and a caller that took the rows for claims would
	// charge under an operation that another claim of the key replaces.
	closed = true
	if err := br.Close(); err != nil {
		return
	}
	for _, p := range claimed {
		p.claimed = true
	}
}

// batchCompleteSQL completes many keys, and writes their staged payments,
// in one statement (see [PostgresStore.BatchCompletions]): completeSQL for
// a batch. $1 to $7 are parallel arrays of the completions (client, key,
// token, status, content type, headers as JSON text or NULL, body); $8 to
// $17 of all their payments, $8 naming the completion (from 1) each
// belongs to. A completion whose claim no longer owns its key (fenced)
// writes nothing, and its payments are not written either. It returns the
// numbers of the completions it made. One statement: if any payment breaks
// a constraint, nothing is written.
const batchCompleteSQL = `
WITH c AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::integer[], $5::text[], $6::text[], $7::bytea[])
        WITH ORDINALITY AS c(client, key, token, status, ctype, hdr, body, i)
), done AS (
    UPDATE idempotency_keys k SET
        status = 'completed',
        response_status = c.status,
        response_content_type = c.ctype,
        response_headers = c.hdr::jsonb,
        response_body = c.body
    FROM c
    WHERE k.client_id = c.client AND k.idempotency_key = c.key AND k.lock_token = c.token AND k.status = 'started'
    RETURNING c.i
), paid AS (
    INSERT INTO payments (payment_id, client_id, customer_id, amount, currency,
        idempotency_key, operation_id, charge_id, created_at)
    SELECT p.id, p.client_id, p.customer, p.amount, p.currency,
        p.key, nullif(p.operation, '')::uuid, nullif(p.charge, ''), coalesce(p.created_at, now())
    FROM unnest($8::bigint[], $9::text[], $10::text[], $11::text[], $12::bigint[], $13::text[],
            $14::text[], $15::text[], $16::text[], $17::timestamptz[])
        AS p(item, id, client_id, customer, amount, currency, key, operation, charge, created_at)
    WHERE p.item IN (SELECT i FROM done)
    RETURNING 1
)
SELECT i FROM done`

// pendingCompletion is one completion in a batch.
type pendingCompletion struct {
	claim    Claim
	resp     StoredResponse
	payments []Payment
	done     chan struct{} // closed when the result below is set

	ok        bool // the batch committed: completed is the outcome
	completed bool // false with ok: fenced
}

// batchComplete runs one completion in a batch. ok says the batch committed,
// and then completed says whether this completion was made (false: the
// claim was fenced). Without ok, the batch failed, and may or may not have
// committed (a lost connection): the caller completes the key with
// completeSQL, where a key found completed under the claim's token was
// completed by the batch.
func (s *PostgresStore) batchComplete(c Claim, resp StoredResponse, payments []Payment) (completed, ok bool) {
	p := &pendingCompletion{claim: c, resp: resp, payments: payments, done: make(chan struct{})}
	s.completions.add(p, func(batch []*pendingCompletion) { s.runCompletionBatch(context.Background(), batch) })
	<-p.done
	return p.completed, p.ok
}

// runCompletionBatch runs batchCompleteSQL for batch and hands every
// completion its result.
func (s *PostgresStore) runCompletionBatch(ctx context.Context, batch []*pendingCompletion) {
	defer func() {
		for _, p := range batch {
			close(p.done)
		}
	}()
	n := len(batch)
	clients, keys, tokens := make([]string, n), make([]string, n), make([]int64, n)
	statuses, ctypes, headers, bodies := make([]int32, n), make([]string, n), make([]*string, n), make([][]byte, n)
	var (
		items                                       []int64
		ids, pclients, customers, currencies, pkeys []string
		operations, charges                         []string
		amounts                                     []int64
		created                                     []pgtype.Timestamptz
	)
	for i, p := range batch {
		clients[i], keys[i], tokens[i] = p.claim.ClientID, p.claim.Key, p.claim.Token
		statuses[i], ctypes[i], bodies[i] = int32(p.resp.Status), p.resp.ContentType, p.resp.Body
		if len(p.resp.Header) > 0 { // else SQL NULL: nothing to replay
			js, err := json.Marshal(p.resp.Header)
			if err != nil {
				return
			}
			h := string(js)
			headers[i] = &h
		}
		for _, pay := range p.payments {
			items = append(items, int64(i+1))
			ids, pclients, customers = append(ids, pay.ID), append(pclients, pay.ClientID), append(customers, pay.Customer)
			amounts, currencies, pkeys = append(amounts, pay.Amount), append(currencies, pay.Currency), append(pkeys, pay.IdempotencyKey)
			operations, charges = append(operations, pay.OperationID), append(charges, pay.ChargeID)
			created = append(created, pgtype.Timestamptz{Time: pay.CreatedAt, Valid: !pay.CreatedAt.IsZero()})
		}
	}
	rows, err := s.pool.Query(ctx, batchCompleteSQL, clients, keys, tokens, statuses, ctypes, headers, bodies,
		items, ids, pclients, customers, amounts, currencies, pkeys, operations, charges, created)
	if err != nil {
		return
	}
	made, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return // not committed, or not known to be: completeSQL decides
	}
	for _, i := range made {
		batch[i-1].completed = true
	}
	for _, p := range batch {
		p.ok = true
	}
}
