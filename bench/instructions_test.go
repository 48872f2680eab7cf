package bench

import (
	"context"
	"flag"
	"testing"
)

// The flags of TestOps, which instructions.sh runs under callgrind.
var (
	opsFlag  = flag.Int("ops", 20, "keyed POSTs TestOps sends through each peer, after the warm-up")
	peerFlag = flag.String("peer", "", "the peer TestOps runs: bare, idem, retryablehttp or failsafe (all if empty)")
	// warmupFlag ops are sent before the -ops counted ones, so that the
	// connection, the pools and the runtime are warm; instructions.sh
	// cancels them out anyway by differencing two op counts. What it
	// cannot cancel is warm-up that ends at random: the runtime fills a
	// type assertion's cache on one miss in 1024, and more rarely as the
	// cache grows (runtime.typeAssert), so io.Copy's assertions, shared
	// by the whole binary, miss for a random many thousand ops.
	warmupFlag = flag.Int("warmup", 10, "keyed POSTs TestOps sends through each peer before the -ops counted ones")
)

// TestOps sends -ops keyed 1 KiB POSTs, answered 201, through -peer to a
// loopback httptest server in the same process, as BenchmarkRoundTrip
// does. instructions.sh runs it under callgrind with two op counts and
// divides the difference of the instruction totals by the difference of
// the counts. Run by go test, it checks with a few ops that the driver
// still works.
func TestOps(t *testing.T) {
	runOps(t, func(t *testing.T, p peer, n int) {
		srv := newServer(t, 0)
		base := baseTransport()
		defer base.CloseIdleConnections()
		rt := p.make(base)
		url := srv.URL + "/v1/payments"
		ctx := context.Background()
		for range n {
			if err := send(ctx, rt, url, p); err != nil {
				t.Fatal(err)
			}
		}
		if got := srv.attempts.Load(); got != int64(n) {
			t.Errorf("server received %d attempts, want %d", got, n)
		}
		if m := srv.missing.Load(); m > 0 {
			t.Errorf("%d attempts had no Idempotency-Key", m)
		}
		// Not an error: a peer may dial again (failsafe-go did once
		// under callgrind), which costs a few instructions per op.
		if c := srv.conns.Load(); c != 1 {
			t.Logf("%d connections", c)
		}
	})
}

// TestStubOps is TestOps over the in-memory base of BenchmarkRoundTripStub
// (instructions.sh with STUB=1): each peer's own cost on the client, with
// no server and no network in the count.
func TestStubOps(t *testing.T) {
	runOps(t, func(t *testing.T, p peer, n int) {
		base := &stubTransport{}
		rt := p.make(base.asHTTP())
		ctx := context.Background()
		for range n {
			if err := send(ctx, rt, "http://stub.invalid/v1/payments", p); err != nil {
				t.Fatal(err)
			}
		}
		if base.attempts != int64(n) {
			t.Errorf("the stub received %d attempts, want %d", base.attempts, n)
		}
	})
}

// runOps runs ops for -peer (every peer if empty) with the warm-up and
// -ops operations.
func runOps(t *testing.T, ops func(t *testing.T, p peer, n int)) {
	found := false
	for _, p := range peers {
		if *peerFlag != "" && p.name != *peerFlag {
			continue
		}
		found = true
		t.Run(p.name, func(t *testing.T) { ops(t, p, *warmupFlag+*opsFlag) })
	}
	if !found {
		t.Fatalf("-peer %q: no such peer", *peerFlag)
	}
}
