package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/testhooks"
	"github.com/idemkit/idem/server/storetest"
)

func TestMemoryStoreConformance(t *testing.T) {
	storetest.Exercise(t, memoryBackend)
}

func TestMemoryStoreSweeperConformance(t *testing.T) {
	storetest.ExerciseSweeper(t, memoryBackend)
}

func TestMemoryStoreInspectorConformance(t *testing.T) {
	storetest.ExerciseInspector(t, memoryBackend)
}

// memoryBackend is a new memory store with its staged writes.
func memoryBackend(t *testing.T) storetest.Backend {
	w := &stagedWrites{
		store:   idempotency.NewMemoryStore(),
		written: make(map[string]bool),
		pending: make(map[idempotency.Tx][]string),
	}
	return storetest.Backend{Store: w.store, Write: w.Write, Written: w.Written,
		Elapse: func(_ context.Context, d time.Duration) error { testhooks.ElapseMemoryStore(w.store, d); return nil }}
}

var errNoUnitOfWork = errors.New("no unit of work of this MemoryStore in the context")

// stagedWrites is a table of names written through MemoryStore.Stage, as a
// handler on a MemoryStore writes its rows: each unit of work stages one
// function, which checks all its writes before it applies any, so that the
// unit of work applies all of them or none.
type stagedWrites struct {
	store *idempotency.MemoryStore

	mu      sync.Mutex
	written map[string]bool
	pending map[idempotency.Tx][]string // the writes of each unit of work
}

func (w *stagedWrites) Write(ctx context.Context, name string) error {
	tx, ok := idempotency.TxFromContext(ctx)
	if !ok {
		return errNoUnitOfWork
	}
	w.mu.Lock()
	names, staged := w.pending[tx]
	w.mu.Unlock()
	if !staged && !w.store.Stage(ctx, func() error { return w.apply(tx) }) {
		return errNoUnitOfWork // another store's unit of work, or a finished one
	}
	if staged && !w.store.Stage(ctx, func() error { return nil }) {
		return errNoUnitOfWork // finished since the first write
	}
	w.mu.Lock()
	w.pending[tx] = append(names, name)
	w.mu.Unlock()
	return nil
}

// apply runs at the completion of tx, under the store's lock.
func (w *stagedWrites) apply(tx idempotency.Tx) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	names := w.pending[tx]
	delete(w.pending, tx)
	seen := make(map[string]bool, len(names))
	for _, name := range names {
		if w.written[name] || seen[name] {
			return fmt.Errorf("write %q: the name is taken", name)
		}
		seen[name] = true
	}
	for _, name := range names {
		w.written[name] = true
	}
	return nil
}

func (w *stagedWrites) Written(ctx context.Context, name string) (bool, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.written[name], nil
}
