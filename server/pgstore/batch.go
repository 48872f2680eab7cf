package pgstore

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/keysql"
)

// batcher gathers the items that arrive while one batch of them is
// running into the next, so that under load one statement and one commit
// serve many requests (see [Store.BatchClaims]). A goroutine runs the batches while
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
	req   idempotency.ClaimRequest
	state atomic.Int32
	done  chan struct{} // closed when the result below is set

	claimed bool // the batch inserted the key's row: claim is the caller's
	claim   idempotency.Claim
}

// batchClaim tries req in a batch. It returns claimed when the batch inserted
// the key's row; otherwise (the key has a row, or the batch failed) the
// caller claims it the usual way, with keysql.ClaimSQL, which also reports a
// database error. A caller whose ctx ends while it waits leaves at once
// with ctx's error; a key the batch then claims for it is released as
// rejected (nothing was done under it), so it does not stay started until
// the lock timeout.
func (s *Store) batchClaim(ctx context.Context, req idempotency.ClaimRequest) (idempotency.Claim, bool, error) {
	if err := ctx.Err(); err != nil {
		return idempotency.Claim{}, false, err
	}
	p := &pendingClaim{req: req, done: make(chan struct{})}
	s.claims.add(p, func(batch []*pendingClaim) { s.runClaimBatch(context.Background(), batch) })
	select {
	case <-p.done:
		return p.claim, p.claimed, nil
	case <-ctx.Done():
		if p.state.CompareAndSwap(claimWaiting, claimAbandoned) {
			return idempotency.Claim{}, false, ctx.Err() // runClaimBatch releases a claim made for p
		}
		<-p.done // handed over just now: the release is the caller's
		if p.claimed {
			_ = s.Release(context.WithoutCancel(ctx), p.claim, idempotency.ReleaseRejected) // best effort, as for a panic
		}
		return idempotency.Claim{}, false, ctx.Err()
	}
}

// runClaimBatch runs keysql.BatchClaimSQL for batch and hands every pending
// claim its result; it releases the keys it claimed for callers that have
// left. On an error every claim is left unclaimed, and each caller claims
// its key with keysql.ClaimSQL, which sees whatever the batch did: a row a lost
// batch did commit is found started, as after a lost keysql.ClaimSQL (see
// [Store.Claim]).
func (s *Store) runClaimBatch(ctx context.Context, batch []*pendingClaim) {
	defer func() {
		for _, p := range batch {
			if !p.state.CompareAndSwap(claimWaiting, claimDelivered) && p.claimed {
				_ = s.Release(ctx, p.claim, idempotency.ReleaseRejected) // its caller has left
			}
			close(p.done)
		}
	}()
	n := len(batch)
	clients, keys, methods, paths := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	hashes, versions := make([][]byte, n), make([]int64, n)
	leases, retentions := make([]int64, n), make([]int64, n)
	for i, p := range batch {
		clients[i], keys[i], methods[i], paths[i] = p.req.ClientID, p.req.Key, p.req.Method, p.req.Path
		hashes[i], versions[i] = p.req.Fingerprint, int64(p.req.FingerprintVersion)
		leases[i], retentions[i] = keysql.Micros(p.req.LockTimeout), keysql.Micros(p.req.Retention)
	}
	b := &pgx.Batch{}
	if s.AsyncClaims {
		b.Queue(keysql.AsyncCommitSQL)
	}
	b.Queue(keysql.BatchClaimSQL, clients, keys, methods, paths, hashes, versions, leases, retentions)
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
		var c idempotency.Claim
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
		return // not committed, or not known to be: keysql.ClaimSQL decides
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
