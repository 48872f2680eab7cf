package sqlstoretest

import (
	"database/sql"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/drivertest"
	"github.com/idemkit/idem/server/sqlstore"
)

// testPoolAsSmallAsRequests runs as many first executions at once as the
// pool has connections, on a new store (nothing prepared yet), each
// handler holding its transaction's connection until all of them hold
// theirs: every statement the store runs in a request's transaction must
// run on that transaction's connection, never wait for another one, or
// the requests wait for each other for ever (lib/pq, on which the store
// prepares its statements, did: it prepared them on the pool).
func testPoolAsSmallAsRequests(t *testing.T, driver string) {
	for _, oneTx := range []bool{false, true} {
		t.Run(fmt.Sprintf("one transaction=%v", oneTx), func(t *testing.T) {
			const n = 4
			db := Open(t, driver)
			db.SetMaxOpenConns(n)
			var all sync.WaitGroup
			all.Add(n)
			release := make(chan struct{})
			go func() { all.Wait(); close(release) }()
			svc := newService(db, sqlstore.New(db), idempotency.Options{OneTransaction: oneTx},
				func(w http.ResponseWriter, r *http.Request, tx *sql.Tx) {
					_, err := tx.ExecContext(r.Context(), `INSERT INTO writes (name) VALUES ($1)`, r.Header.Get("Idempotency-Key"))
					all.Done()
					if err != nil {
						http.Error(w, err.Error(), http.StatusInternalServerError)
						return
					}
					select {
					case <-release:
					case <-time.After(10 * time.Second): // some request never reached its handler
					}
					w.WriteHeader(http.StatusCreated)
				})
			statuses := make(chan int, n)
			for i := range n {
				go func() {
					rec, _ := send(svc.h, fmt.Sprintf("pool-%d", i))
					statuses <- rec.Code
				}()
			}
			deadline := time.After(2 * time.Minute)
			for range n {
				select {
				case status := <-statuses:
					if status != http.StatusCreated {
						t.Errorf("status %d, want 201", status)
					}
				case <-deadline:
					t.Fatalf("%d requests on a pool of %d connections still wait after 2 minutes: the store waits for a connection while each request holds one", n, n)
				}
			}
		})
	}
}

// testSmallPoolAnswersEveryRequest and testSmallPoolStopsGracefully are
// drivertest's, which pgstore runs too.
func testSmallPoolAnswersEveryRequest(t *testing.T, driver string) {
	drivertest.SmallPoolAnswersEveryRequest(t, smallPoolService(driver))
}

func testSmallPoolStopsGracefully(t *testing.T, driver string) {
	drivertest.SmallPoolStopsGracefully(t, smallPoolService(driver))
}

// smallPoolService is drivertest's NewService on sqlstore and driver.
func smallPoolService(driver string) drivertest.NewService {
	return func(t *testing.T, level string, conns int, opts idempotency.Options, hold http.HandlerFunc) (http.Handler, func() int) {
		db := openAt(t, driver, level)
		db.SetMaxOpenConns(conns)
		svc := newService(db, sqlstore.New(db), opts, func(w http.ResponseWriter, r *http.Request, tx *sql.Tx) {
			if _, err := tx.ExecContext(r.Context(), `INSERT INTO writes (name) VALUES ($1)`, r.Header.Get("Idempotency-Key")); err != nil {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			}
			hold(w, r)
		})
		return svc.h, func() int { return db.Stats().InUse }
	}
}
