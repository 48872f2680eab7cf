package pgstore_test

import (
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

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/server/idempotency"
)

// TestSmallPoolAnswersEveryRequest serves twice as many concurrent
// requests as the pool has connections, each holding its transaction's
// connection while it calls a slow downstream system after its insert,
// with a lock timeout shorter than that call, so that renewals wait for
// connections too: every request is answered (at worst with an error),
// none hangs, and the pool is whole afterwards. The renewals and the
// transactions' begins share a lock, which must never be held while
// waiting for a connection; under REPEATABLE READ, renewals then only check.
func TestSmallPoolAnswersEveryRequest(t *testing.T) {
	for _, level := range []string{"", "repeatable read"} {
		t.Run(fmt.Sprintf("isolation %q", level), func(t *testing.T) {
			const conns, requests = 4, 8
			release := make(chan struct{})
			held := make(chan struct{}, requests)
			s := newService(t, idempotency.Options{LockTimeout: 150 * time.Millisecond},
				func(cfg *pgxpool.Config) { cfg.MaxConns = conns; withIsolation(level)(cfg) },
				func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
					if err := insert(r.Context(), tx, s2row(r)); err != nil {
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
			var wg sync.WaitGroup
			statuses := make([]int, requests)
			for i := range requests {
				wg.Go(func() { statuses[i], _ = s.send(fmt.Sprint("k", i)) })
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
			for deadline := time.Now().Add(10 * time.Second); s.pool.Stat().AcquiredConns() != 0; time.Sleep(10 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("%d connections still acquired 10 s after every request ended", s.pool.Stat().AcquiredConns())
				}
			}
			t.Logf("statuses: %v", statuses)
		})
	}
}

// TestSmallPoolStopsGracefully stops a service on a pool half the size of
// its in-flight requests, each holding its transaction's connection
// across a downstream call that does not answer: the graceful stop runs
// out its timeout, the forced close cancels the requests, and the pool
// then closes, every connection back: the stop ends, whatever the renewals
// were waiting for. The renewals and the begins share a lock that a
// request waiting on it must never hold a connection for, at either level.
func TestSmallPoolStopsGracefully(t *testing.T) {
	for _, level := range []string{"", "repeatable read"} {
		t.Run(fmt.Sprintf("isolation %q", level), func(t *testing.T) {
			const conns, requests = 4, 8
			held := make(chan struct{}, requests)
			s := newService(t, idempotency.Options{LockTimeout: 150 * time.Millisecond},
				func(cfg *pgxpool.Config) { cfg.MaxConns = conns; withIsolation(level)(cfg) },
				func(w http.ResponseWriter, r *http.Request, tx pgx.Tx) {
					if err := insert(r.Context(), tx, s2row(r)); err != nil {
						http.Error(w, err.Error(), http.StatusServiceUnavailable)
						return
					}
					held <- struct{}{}
					<-r.Context().Done() // the downstream call, which never answers
					w.WriteHeader(http.StatusServiceUnavailable)
				})
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				s.h.ServeHTTP(w, r.WithContext(idempotency.WithClientID(r.Context(), "cli_a")))
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
				s.pool.Close() // waits for every connection to come back
				stopped <- err
			}()
			select {
			case err := <-stopped:
				if !errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("Shutdown with handlers waiting on the downstream: %v, want its timeout", err)
				}
			case <-time.After(time.Minute):
				t.Fatal("the service had not stopped a minute after its graceful stop timed out (a deadlock)")
			}
		})
	}
}

// s2row names a row of the request r.
func s2row(r *http.Request) string { return r.Header.Get("Idempotency-Key") + "/row/1" }
