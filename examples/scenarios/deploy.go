package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/server"
)

// deployDrain is how long instance A of the deploy scenario drains before
// it closes its connections, as a platform's grace period after SIGTERM;
// the payment in flight takes longer (deployProcessorDelay).
const (
	deployDrain          = 200 * time.Millisecond
	deployProcessorDelay = 700 * time.Millisecond
)

// deploy: the payment goes over HTTP/2 to instance A. A deploy starts
// while it runs: the load balancer sends new connections to instance B,
// on the same storage, and A shuts down gracefully: it sends GOAWAY, lets
// the request run for its drain time, then closes the connection with the
// answer not yet sent. The client retries with the same key, reaches B,
// which sees the key still started (A's request runs on and renews its
// lease) and answers 409 until A's outcome is stored, then replays it: one
// payment, one charge, though two servers saw the request.
func deploy(ctx context.Context, e *env) (err error) {
	b, err := server.New(e.cfg)
	if err != nil {
		return fmt.Errorf("starting instance B: %w", err)
	}
	defer func() { err = errors.Join(err, b.Close()) }()

	var seenA, seenB atomic.Int32
	arrived := make(chan string, 1)
	// running counts the requests in the instances' handlers: closing a
	// connection does not end its request, and A's runs on after the
	// deploy, to its end, as it would in a process that has yet to exit.
	var running sync.WaitGroup
	instance := func(name string, h http.Handler, seen *atomic.Int32) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			running.Add(1)
			defer running.Done()
			if r.Method == http.MethodPost {
				seen.Add(1)
				e.tl.note("instance %s receives the payment over %s", name, r.Proto)
				select {
				case arrived <- r.Proto:
				default:
				}
			}
			h.ServeHTTP(w, r)
		})
	}
	tsA := startHTTP2(instance("A", e.srv, &seenA))
	defer tsA.Close() // waits for A's request to end
	tsB := startHTTP2(instance("B", b, &seenB))
	defer tsB.Close()
	defer running.Wait()

	// The load balancer: the service's address leads to the instance in
	// rotation. example.com is the name the test certificate of httptest
	// is for; nothing leaves the loopback interface.
	var rotation atomic.Pointer[string]
	addrA, addrB := tsA.Listener.Addr().String(), tsB.Listener.Addr().String()
	rotation.Store(&addrA)
	roots := x509.NewCertPool()
	roots.AddCert(tsA.Certificate())
	var dialer net.Dialer
	base := &http.Transport{
		TLSClientConfig:   &tls.Config{RootCAs: roots},
		ForceAttemptHTTP2: true,
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return dialer.DialContext(ctx, network, *rotation.Load())
		},
	}
	defer base.CloseIdleConnections()
	tr := e.transport(policy)
	tr.Base = base
	c := &idem.Client{BaseURL: "https://example.com", Token: token, HTTPClient: &http.Client{Transport: tr}}

	cus := customer("deploy")
	done := e.payAsync(ctx, c, "pay", payment{Amount: 4200, Currency: "usd", Customer: cus})
	var proto string
	select {
	case proto = <-arrived:
	case a := <-done:
		return fmt.Errorf("the payment ended before it reached instance A: %v", a.err)
	}
	e.expect(proto == "HTTP/2.0", "the payment reached A over %s", proto)

	e.tl.note("deploy: new connections go to B; A gets SIGTERM and drains for %s", deployDrain)
	rotation.Store(&addrB)
	dctx, cancel := context.WithTimeout(ctx, deployDrain)
	err = tsA.Config.Shutdown(dctx) // GOAWAY, then wait for the request
	cancel()
	if errors.Is(err, context.DeadlineExceeded) {
		e.tl.fault("A's drain time is over with the payment still running: A closes its connections")
		tsA.CloseClientConnections()
	} else {
		e.expect(false, "A drained before the payment ended (Shutdown: %v); the story needs it to run longer", err)
	}

	a := <-done
	if a.err != nil {
		e.expect(false, "the payment ended in an error: %v", a.err)
		return e.expectStored(ctx, cus, 1, 1)
	}
	e.expect(a.resp.StatusCode == http.StatusCreated, "the client got %s", statusLine(a.resp.StatusCode))
	e.expect(seenA.Load() == 1 && seenB.Load() >= 1,
		"the retry, with the same key, reached B (A saw %d attempt, B %d)", seenA.Load(), seenB.Load())
	e.expect(e.tl.keys() == 1, "one key for every attempt")
	return e.expectStored(ctx, cus, 1, 1)
}

// startHTTP2 serves h over HTTP/2 with TLS on a loopback port, with the
// certificate of httptest, and no log of connection errors: a deploy
// makes some on purpose.
func startHTTP2(h http.Handler) *httptest.Server {
	ts := httptest.NewUnstartedServer(h)
	ts.EnableHTTP2 = true
	ts.Config.ErrorLog = log.New(io.Discard, "", 0)
	ts.StartTLS()
	return ts
}
