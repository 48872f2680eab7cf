package bench

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/failsafe-go/failsafe-go"
	"github.com/failsafe-go/failsafe-go/failsafehttp"
	"github.com/hashicorp/go-retryablehttp"

	"github.com/idemkit/idem"
)

// bodySize is the size of the JSON request body of every benchmark.
const bodySize = 1 << 10

// payload is a 1 KiB JSON payment request, the same bytes for every peer.
var payload = func() []byte {
	head := `{"amount":4200,"currency":"usd","customer":"cus_123","description":"`
	tail := `"}`
	pad := strings.Repeat("x", bodySize-len(head)-len(tail))
	b := []byte(head + pad + tail)
	if len(b) != bodySize {
		panic(fmt.Sprintf("payload is %d bytes", len(b)))
	}
	return b
}()

// created is the body of the 201 answer.
var created = []byte(`{"id":"pay_0123456789abcdef01234567","object":"payment","amount":4200,"currency":"usd","customer":"cus_123"}` + "\n")

// unavailable is the body of the 503 answer of the faulty server.
var unavailable = []byte(`{"type":"about:blank","title":"Service Unavailable","status":503}` + "\n")

// server is a loopback payments endpoint. With failEvery > 0 it answers 503
// with Retry-After: 0 to every failEvery-th attempt it receives (the 3rd,
// 6th, 9th, ...: a deterministic sequence), and 201 to the others.
type server struct {
	*httptest.Server
	failEvery int64
	attempts  atomic.Int64 // requests received
	missing   atomic.Int64 // of which without an Idempotency-Key
	conns     atomic.Int64 // connections accepted
}

func newServer(tb testing.TB, failEvery int64) *server {
	s := &server{failEvery: failEvery}
	s.Server = httptest.NewUnstartedServer(http.HandlerFunc(s.serve))
	s.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			s.conns.Add(1)
		}
	}
	s.Start()
	tb.Cleanup(s.Close)
	return s
}

func (s *server) serve(w http.ResponseWriter, r *http.Request) {
	n := s.attempts.Add(1)
	if r.Header.Get("Idempotency-Key") == "" {
		s.missing.Add(1)
	}
	_, _ = io.Copy(io.Discard, r.Body)
	h := w.Header()
	if s.failEvery > 0 && n%s.failEvery == 0 {
		h["Content-Type"] = []string{"application/problem+json"}
		h["Retry-After"] = []string{"0"}
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = w.Write(unavailable)
		return
	}
	h["Content-Type"] = []string{"application/json"}
	w.WriteHeader(http.StatusCreated)
	_, _ = w.Write(created)
}

// baseTransport returns a fresh pooled transport of its own, so that each
// peer starts with no idle connection and reuses its own.
func baseTransport() *http.Transport {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.MaxIdleConnsPerHost = 16
	return t
}

// maxAttempts is the attempt limit given to every peer (idem's default).
const maxAttempts = idem.DefaultMaxAttempts

// peer is one way to send the keyed POST.
type peer struct {
	name string
	// setsKey says whether the peer adds the Idempotency-Key itself; for
	// those that do not, the benchmark sets a new UUIDv4 on each request,
	// as a user of that peer would (with the same generator, idem.NewKey).
	setsKey bool
	// firstSent says whether the benchmark sets Repeatability-First-Sent
	// on each request, as idem's Transport does on every keyed attempt:
	// with it, bare sends the bytes idem sends.
	firstSent bool
	// make returns the RoundTripper of the peer on base.
	make func(base *http.Transport) http.RoundTripper
}

var peers = []peer{
	{name: "bare", make: func(base *http.Transport) http.RoundTripper { return base }},
	// bare-firstsent is bare with the request idem writes: the key and the
	// time the operation was first sent (issue 20's Repeatability-First-Sent),
	// which the server parses too. idem against it is idem's own cost on
	// equal wire bytes.
	{name: "bare-firstsent", firstSent: true, make: func(base *http.Transport) http.RoundTripper { return base }},
	// idem-nofirstsent is idem without the header (Transport.NoFirstSent):
	// its cost against bare on equal wire bytes, the other way round.
	{name: "idem-nofirstsent", setsKey: true, make: func(base *http.Transport) http.RoundTripper {
		return &idem.Transport{Base: base, DisableBudget: true, NoFirstSent: true}
	}},
	{name: "idem", setsKey: true, make: func(base *http.Transport) http.RoundTripper {
		// The peers have no retry budget; without it, idem's default
		// budget (100 tokens, 0.1 earned per success) would run dry
		// under a steady third of failures, which is what it is for.
		return &idem.Transport{Base: base, DisableBudget: true}
	}},
	{name: "retryablehttp", make: func(base *http.Transport) http.RoundTripper {
		c := retryablehttp.NewClient()
		c.HTTPClient = &http.Client{Transport: base}
		c.Logger = nil // its default logs every request to stderr
		c.RetryMax = maxAttempts - 1
		c.RetryWaitMin = idem.DefaultInitialInterval
		c.RetryWaitMax = idem.DefaultMaxInterval
		return &retryablehttp.RoundTripper{Client: c}
	}},
	{name: "failsafe", make: func(base *http.Transport) http.RoundTripper {
		rp := failsafehttp.NewRetryPolicyBuilder().
			WithMaxAttempts(maxAttempts).
			// failsafe-go leaves the body of a retried response open: the
			// user must drain and close it, or every retry leaks a
			// connection (see bench/NOTES.md).
			OnRetryScheduled(func(e failsafe.ExecutionScheduledEvent[*http.Response]) {
				if resp := e.LastResult(); resp != nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			}).
			Build()
		return failsafehttp.NewRoundTripper(base, rp)
	}},
}

// handRetry is what a user of plain net/http writes by hand: the same key
// and GetBody on every attempt, a retry at once on 503 (the faulty server
// says Retry-After: 0), nothing else: the floor under the retrying peers.
type handRetry struct{ base *http.Transport }

func (h *handRetry) RoundTrip(req *http.Request) (*http.Response, error) {
	for attempt := 1; ; attempt++ {
		resp, err := h.base.RoundTrip(req)
		if err != nil || resp.StatusCode != http.StatusServiceUnavailable || attempt == maxAttempts {
			return resp, err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		body, err := req.GetBody()
		if err != nil {
			return nil, err
		}
		r2 := *req // a shallow copy: the header, with its key, is shared
		r2.Body = body
		req = &r2
	}
}

// BenchmarkRoundTrip sends a keyed POST with a 1 KiB JSON body, answered
// 201 at the first attempt, through each peer.
func BenchmarkRoundTrip(b *testing.B) {
	for _, p := range peers {
		b.Run(p.name, func(b *testing.B) { runPeer(b, p, 0) })
	}
}

// BenchmarkRoundTripFaults is BenchmarkRoundTrip against a server that
// answers every third attempt with 503 and Retry-After: 0. There "bare" is
// plain http.Transport under the loop a user writes by hand (handRetry).
func BenchmarkRoundTripFaults(b *testing.B) {
	for _, p := range peers {
		if p.name == "bare" {
			p.make = func(base *http.Transport) http.RoundTripper { return &handRetry{base: base} }
		}
		b.Run(p.name, func(b *testing.B) { runPeer(b, p, 3) })
	}
}

func runPeer(b *testing.B, p peer, failEvery int64) {
	srv := newServer(b, failEvery)
	base := baseTransport()
	defer base.CloseIdleConnections()
	rt := p.make(base)
	url := srv.URL + "/v1/payments"
	ctx := context.Background()

	// Warm up the connection, outside the measurement.
	if err := send(ctx, rt, url, p); err != nil {
		b.Fatal(err)
	}
	srv.attempts.Store(0)
	srv.missing.Store(0)
	conns0 := srv.conns.Load()

	var ops, failed, retried int64
	var retriedTime time.Duration
	b.ReportAllocs()
	for b.Loop() {
		ops++
		if failEvery == 0 {
			if err := send(ctx, rt, url, p); err != nil {
				b.Fatal(err)
			}
			continue
		}
		before := srv.attempts.Load()
		start := time.Now()
		if err := send(ctx, rt, url, p); err != nil {
			failed++
		}
		if srv.attempts.Load()-before > 1 {
			retried++
			retriedTime += time.Since(start)
		}
	}
	b.StopTimer()
	attempts := srv.attempts.Load()
	if m := srv.missing.Load(); m > 0 {
		b.Fatalf("%d of %d attempts had no Idempotency-Key", m, attempts)
	}
	b.ReportMetric(float64(attempts)/float64(ops), "attempts/op")
	if failEvery > 0 {
		// Every operation of a loop ends in success or failure, so the
		// mean time to success is ns/op; this is the mean of those that
		// needed a retry, the cost of one 503 handled.
		if retried > 0 {
			b.ReportMetric(float64(retriedTime.Nanoseconds())/float64(retried), "retried-ns/op")
		}
		b.ReportMetric(float64(failed)/float64(ops), "failed/op")
		b.ReportMetric(float64(srv.conns.Load()-conns0)/float64(ops), "dials/op")
	}
}

// send makes one operation: a new request from the same body source
// (a bytes.Reader, so http.NewRequest sets GetBody), sent through rt, its
// answer read to the end and closed.
func send(ctx context.Context, rt http.RoundTripper, url string, p peer) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(payload))
	if err != nil {
		return err
	}
	req.Header["Content-Type"] = []string{"application/json"}
	if !p.setsKey {
		req.Header["Idempotency-Key"] = []string{idem.NewKey()}
	}
	if p.firstSent {
		req.Header["Repeatability-First-Sent"] = []string{time.Now().UTC().Format(http.TimeFormat)}
	}
	resp, err := rt.RoundTrip(req)
	if err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusCreated {
		return fmt.Errorf("status %s", resp.Status)
	}
	return nil
}

// BenchmarkRoundTripStub is BenchmarkRoundTrip over an in-memory base
// transport instead of loopback TCP: no network, no server goroutines, so
// what is left is each peer's own cost on the client, measured with far
// less noise. The base reads the request body and answers a canned 201.
func BenchmarkRoundTripStub(b *testing.B) {
	for _, p := range peers {
		b.Run(p.name, func(b *testing.B) {
			base := &stubTransport{}
			rt := p.make(base.asHTTP())
			ctx := context.Background()
			if err := send(ctx, rt, "http://stub.invalid/v1/payments", p); err != nil {
				b.Fatal(err)
			}
			base.attempts = 0
			var ops int64
			b.ReportAllocs()
			for b.Loop() {
				ops++
				if err := send(ctx, rt, "http://stub.invalid/v1/payments", p); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(base.attempts)/float64(ops), "attempts/op")
		})
	}
}

// stubTransport answers every request 201 in memory.
type stubTransport struct{ attempts int64 }

// asHTTP returns an *http.Transport that sends everything to s, so that
// the peers' constructors, which take an *http.Transport, can be reused:
// http.Transport hands a request for a registered scheme to its
// RoundTripper.
func (s *stubTransport) asHTTP() *http.Transport {
	t := &http.Transport{}
	t.RegisterProtocol("http", s)
	return t
}

func (s *stubTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	s.attempts++
	if req.Header.Get("Idempotency-Key") == "" {
		return nil, fmt.Errorf("no Idempotency-Key")
	}
	if req.Body != nil {
		_, _ = io.Copy(io.Discard, req.Body)
		req.Body.Close()
	}
	return &http.Response{
		Status:        "201 Created",
		StatusCode:    http.StatusCreated,
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        http.Header{"Content-Type": {"application/json"}},
		Body:          io.NopCloser(bytes.NewReader(created)),
		ContentLength: int64(len(created)),
		Request:       req,
	}, nil
}
