package sqlstoretest

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
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

// isolations are the default_transaction_isolation settings the small
// pool tests run under: the server's (READ COMMITTED), and REPEATABLE
// READ, where renewals only check once a transaction has begun.
var isolations = []string{"", "repeatable read"}

// testSmallPoolAnswersEveryRequest is pgstore's test of the same name on
// sqlstore: twice as many concurrent requests as the pool has
// connections, each holding its transaction's connection across a slow
// downstream call after its insert, with a lease shorter than that call,
// so that renewals wait for connections too (and for the transactions'
// begins, which share a lock with them), at READ COMMITTED and at
// REPEATABLE READ: every request is answered, none hangs, and the pool is
// whole afterwards.
func testSmallPoolAnswersEveryRequest(t *testing.T, driver string) {
	for _, level := range isolations {
		t.Run(cmp.Or(level, "default"), func(t *testing.T) {
			const conns, requests = 4, 8
			db := openAt(t, driver, level)
			db.SetMaxOpenConns(conns)
			store := sqlstore.New(db)
			held := make(chan struct{}, requests)
			release := make(chan struct{})
			svc := newService(db, store, idempotency.Options{LockTimeout: 150 * time.Millisecond},
				func(w http.ResponseWriter, r *http.Request, tx *sql.Tx) {
					if _, err := tx.ExecContext(r.Context(), `INSERT INTO writes (name) VALUES ($1)`, r.Header.Get("Idempotency-Key")); err != nil {
						http.Error(w, err.Error(), http.StatusServiceUnavailable)
						return
					}
					held <- struct{}{}
					select { // the downstream call, the connection held
					case <-release:
					case <-r.Context().Done():
					}
					w.WriteHeader(http.StatusCreated)
				})
			statuses := make([]int, requests)
			var wg sync.WaitGroup
			for i := range requests {
				wg.Go(func() {
					rec, _ := send(svc.h, fmt.Sprintf("small-%d", i))
					statuses[i] = rec.Code
				})
			}
			done := make(chan struct{})
			go func() { wg.Wait(); close(done) }()
			for range conns {
				<-held
			}
			// Renewals come due every 50 ms and wait for a connection; the
			// pool stays full for a few of them (no timing is asserted).
			select {
			case <-done:
			case <-time.After(6 * 150 * time.Millisecond):
			}
			close(release)
			select {
			case <-done:
			case <-time.After(time.Minute):
				t.Fatalf("requests still unanswered a minute after the downstream answered (a deadlock): %v", statuses)
			}
			for i, st := range statuses {
				if st == 0 {
					t.Errorf("request %d: no answer", i)
				}
			}
			for deadline := time.Now().Add(10 * time.Second); db.Stats().InUse != 0; time.Sleep(10 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("%d connections still in use 10 s after every request ended", db.Stats().InUse)
				}
			}
			t.Logf("statuses: %v", statuses)
		})
	}
}

// testSmallPoolStopsGracefully is pgstore's test of the same name on
// sqlstore: a service on a pool half the size of its in-flight requests,
// each holding its transaction's connection across a downstream call that
// does not answer, is stopped; the graceful stop runs out its timeout, the
// forced close cancels the requests, and every connection comes back, at
// READ COMMITTED and at REPEATABLE READ.
func testSmallPoolStopsGracefully(t *testing.T, driver string) {
	for _, level := range isolations {
		t.Run(cmp.Or(level, "default"), func(t *testing.T) {
			const conns, requests = 4, 8
			db := openAt(t, driver, level)
			db.SetMaxOpenConns(conns)
			store := sqlstore.New(db)
			held := make(chan struct{}, requests)
			svc := newService(db, store, idempotency.Options{LockTimeout: 150 * time.Millisecond},
				func(w http.ResponseWriter, r *http.Request, tx *sql.Tx) {
					if _, err := tx.ExecContext(r.Context(), `INSERT INTO writes (name) VALUES ($1)`, r.Header.Get("Idempotency-Key")); err != nil {
						http.Error(w, err.Error(), http.StatusServiceUnavailable)
						return
					}
					held <- struct{}{}
					<-r.Context().Done() // the downstream call, which never answers
					w.WriteHeader(http.StatusServiceUnavailable)
				})
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				svc.h.ServeHTTP(w, r.WithContext(idempotency.WithClientID(r.Context(), "cli_a")))
			}))
			var wg sync.WaitGroup
			for i := range requests {
				wg.Go(func() {
					req, _ := http.NewRequest("POST", srv.URL+"/v1/orders", strings.NewReader(`{"item":"book"}`))
					req.Header.Set("Idempotency-Key", fmt.Sprint("stop-", i))
					if resp, err := srv.Client().Do(req); err == nil {
						io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
					}
				})
			}
			for range conns {
				<-held
			}
			stopped := make(chan error, 1)
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
				defer cancel()
				err := srv.Config.Shutdown(ctx)
				srv.Config.Close() // cuts the requests still in flight, as a service does after its timeout
				srv.Close()        // waits for their handlers
				wg.Wait()
				for db.Stats().InUse != 0 {
					time.Sleep(10 * time.Millisecond)
				}
				stopped <- err
			}()
			select {
			case err := <-stopped:
				if !errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("Shutdown with handlers waiting on the downstream: %v, want its timeout", err)
				}
			case <-time.After(time.Minute):
				t.Fatalf("the service had not stopped a minute after its graceful stop timed out (a deadlock); %d connections in use", db.Stats().InUse)
			}
		})
	}
}
