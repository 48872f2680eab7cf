// Package drivertest holds the tests that the two PostgreSQL stores share,
// pgstore on pgx and sqlstore on database/sql, written once: each store's
// tests run them on their own driver, through the few calls that differ
// ([NewService], [Pool]). Behaviour every [idempotency.Store] has belongs
// to the conformance suite (package storetest); these tests need what
// only the PostgreSQL stores have: a pool of connections, a handler's
// transaction on one of them, CreateOpenKeysIndex, a pooler.
package drivertest

import (
	"cmp"
	"context"
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
)

// NewService returns POST /v1/orders behind [idempotency.Middleware] with
// opts, for client cli_a (from the request's context), on a store on a new
// pool of conns connections on a fresh schema, whose sessions begin their
// transactions at level (default_transaction_isolation; "" leaves the
// server's default). Its handler inserts a row named by the request's
// Idempotency-Key into the writes table, in the request's transaction,
// and answers 503 if that fails; then it calls hold. inUse returns the
// number of the pool's connections in use.
type NewService func(t *testing.T, level string, conns int, opts idempotency.Options, hold http.HandlerFunc) (h http.Handler, inUse func() int)

// levels are the default_transaction_isolation settings the small pool
// tests run at: the server's default and REPEATABLE READ, under which the
// renewals and the transactions' begins share a lock.
var levels = []string{"", "repeatable read"}

// smallPool is the pool of the small pool tests, half as many
// connections as the requests in flight; their lease is renewed every
// 50 ms, so that renewals wait for connections too.
const (
	conns, requests = 4, 8
	lease           = 150 * time.Millisecond
)

// SmallPoolAnswersEveryRequest serves twice as many concurrent requests as
// the pool has connections, each holding its transaction's connection
// while it calls a slow downstream system after its insert, with a lock
// timeout shorter than that call, so that renewals wait for connections
// too: every request is answered (at worst with an error), none hangs,
// and the pool is whole afterwards. The renewals and the transactions'
// begins share a lock, which must never be held while waiting for a
// connection.
func SmallPoolAnswersEveryRequest(t *testing.T, newService NewService) {
	for _, level := range levels {
		t.Run(cmp.Or(level, "default"), func(t *testing.T) {
			release := make(chan struct{})
			held := make(chan struct{}, requests)
			h, inUse := newService(t, level, conns, idempotency.Options{LockTimeout: lease}, func(w http.ResponseWriter, r *http.Request) {
				held <- struct{}{}
				select { // the downstream call, the connection held
				case <-release:
				case <-r.Context().Done():
				}
				w.WriteHeader(http.StatusCreated)
			})
			var wg sync.WaitGroup
			statuses := make([]int, requests)
			for i := range requests {
				wg.Go(func() {
					r := httptest.NewRequestWithContext(idempotency.WithClientID(context.Background(), "cli_a"),
						"POST", "/v1/orders", strings.NewReader(`{"item":"book"}`))
					r.Header.Set("Idempotency-Key", fmt.Sprint("small-", i))
					rec := httptest.NewRecorder()
					h.ServeHTTP(rec, r)
					statuses[i] = rec.Code
				})
			}
			done := make(chan struct{})
			go func() { wg.Wait(); close(done) }()
			// The pool is full of held transactions, the other requests
			// and then, again and again, renewals waiting for a
			// connection (or the leases lost, and the requests answered);
			// then the downstream answers.
			for range conns {
				<-held
			}
			// Renewals come due every 50 ms and wait for a connection;
			// the test holds the pool full for a few of them (it passes
			// whatever they did meanwhile: no timing is asserted).
			select {
			case <-done:
			case <-time.After(6 * lease):
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
			for deadline := time.Now().Add(10 * time.Second); inUse() != 0; time.Sleep(10 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("%d connections still in use 10 s after every request ended", inUse())
				}
			}
			t.Logf("statuses: %v", statuses)
		})
	}
}

// SmallPoolStopsGracefully stops a service on a pool half the size of its
// in-flight requests, each holding its transaction's connection across a
// downstream call that does not answer: the graceful stop runs out its
// timeout, the forced close cancels the requests, and every connection
// comes back: the stop ends, whatever the renewals were waiting for. The
// renewals and the begins share a lock that a request waiting on it must
// never hold a connection for.
func SmallPoolStopsGracefully(t *testing.T, newService NewService) {
	for _, level := range levels {
		t.Run(cmp.Or(level, "default"), func(t *testing.T) {
			held := make(chan struct{}, requests)
			h, inUse := newService(t, level, conns, idempotency.Options{LockTimeout: lease}, func(w http.ResponseWriter, r *http.Request) {
				held <- struct{}{}
				<-r.Context().Done() // the downstream call, which never answers
				w.WriteHeader(http.StatusServiceUnavailable)
			})
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				h.ServeHTTP(w, r.WithContext(idempotency.WithClientID(r.Context(), "cli_a")))
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
				ctx, cancel := context.WithTimeout(context.Background(), 2*lease)
				defer cancel()
				err := srv.Config.Shutdown(ctx)
				srv.Config.Close() // cuts the requests still in flight, as a service does after its timeout
				srv.Close()        // waits for their handlers
				wg.Wait()
				for inUse() != 0 {
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
				t.Fatalf("the service had not stopped a minute after its graceful stop timed out (a deadlock); %d connections in use", inUse())
			}
		})
	}
}
