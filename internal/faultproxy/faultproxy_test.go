package faultproxy

import (
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// backend is an HTTP server that answers its name and counts the requests
// it served.
type backend struct {
	*httptest.Server
	served atomic.Int64
}

func newBackend(t *testing.T, name string) *backend {
	t.Helper()
	b := &backend{}
	b.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.served.Add(1)
		io.WriteString(w, name)
	}))
	t.Cleanup(b.Close)
	return b
}

func (b *backend) addr() string { return b.Listener.Addr().String() }

func start(t *testing.T, cfg Config) *Proxy {
	t.Helper()
	p, err := Listen("127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// get makes one request on a connection of its own.
func get(t *testing.T, p *Proxy, timeout time.Duration) (string, error) {
	t.Helper()
	tr := &http.Transport{DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: timeout}
	resp, err := c.Get("http://" + p.Addr() + "/")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// deadAddr returns a loopback address nothing listens on.
func deadAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

func TestPassRoundRobin(t *testing.T) {
	a, b := newBackend(t, "a"), newBackend(t, "b")
	p := start(t, Config{Targets: []string{a.addr(), b.addr()}})
	var got []string
	for range 4 {
		body, err := get(t, p, 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, body)
	}
	if want := []string{"a", "b", "a", "b"}; !slices.Equal(got, want) {
		t.Errorf("answers %q, want %q (round-robin)", got, want)
	}
	s := p.Stats()
	if s.Connections != 4 || s.Faults[Pass] != 4 || s.ByTarget[a.addr()] != 2 || s.ByTarget[b.addr()] != 2 {
		t.Errorf("stats %+v: want 4 connections, all passed, 2 per target", s)
	}
}

func TestFailover(t *testing.T) {
	a := newBackend(t, "a")
	p := start(t, Config{Targets: []string{deadAddr(t), a.addr()}})
	for range 4 {
		if body, err := get(t, p, 10*time.Second); err != nil || body != "a" {
			t.Fatalf("got %q, %v; want the live target's answer", body, err)
		}
	}
	if s := p.Stats(); s.Failovers != 2 || s.Unreachable != 0 {
		t.Errorf("failovers %d, unreachable %d; want 2 and 0", s.Failovers, s.Unreachable)
	}
}

func TestUnreachable(t *testing.T) {
	p := start(t, Config{Targets: []string{deadAddr(t)}})
	if _, err := get(t, p, 10*time.Second); err == nil {
		t.Fatal("request through a proxy with no live target succeeded")
	}
	if s := p.Stats(); s.Unreachable != 1 {
		t.Errorf("unreachable %d, want 1", s.Unreachable)
	}
}

func TestSetTarget(t *testing.T) {
	a, b := newBackend(t, "a"), newBackend(t, "b")
	p := start(t, Config{Targets: []string{a.addr()}})
	p.SetTarget(0, b.addr())
	if body, err := get(t, p, 10*time.Second); err != nil || body != "b" {
		t.Fatalf("got %q, %v; want the new target's answer", body, err)
	}
}

func TestFaults(t *testing.T) {
	tests := []struct {
		name       string
		mix        Mix
		wantErr    bool
		wantServed int64 // requests the backend processed
	}{
		{"reset before the request", Mix{Reset: 1}, true, 0},
		{"answer dropped after the server answered", Mix{Drop: 1}, true, 1},
		{"answer stalled past the client's timeout", Mix{Stall: 1}, true, 1},
		{"latency", Mix{Latency: 1}, false, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := newBackend(t, "ok")
			p := start(t, Config{Targets: []string{b.addr()}, Mix: tt.mix, MaxLatency: time.Millisecond, StallFor: time.Minute})
			body, err := get(t, p, 2*time.Second)
			if gotErr := err != nil; gotErr != tt.wantErr {
				t.Errorf("got %q, %v; want an error: %v", body, err, tt.wantErr)
			}
			if !tt.wantErr && body != "ok" {
				t.Errorf("body %q, want ok", body)
			}
			// The backend counts before it answers; the client has its
			// outcome only after that, except after a reset, where the
			// request may never arrive.
			if got := b.served.Load(); got != tt.wantServed {
				t.Errorf("backend served %d requests, want %d", got, tt.wantServed)
			}
			if got := p.Stats().Faults; len(got) != 1 {
				t.Errorf("faults %v, want one kind", got)
			}
		})
	}
}

func TestResetIsConnectionReset(t *testing.T) {
	b := newBackend(t, "ok")
	p := start(t, Config{Targets: []string{b.addr()}, Mix: Mix{Reset: 1}})
	// The reset may come before the dial returns or on the first read.
	c, err := net.Dial("tcp", p.Addr())
	if err == nil {
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		_, err = c.Read(make([]byte, 1))
	}
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("got %v, want connection reset by peer", err)
	}
}

func TestHalfClose(t *testing.T) {
	// An echo server that answers once the client has finished sending.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		b, _ := io.ReadAll(c)
		c.Write(b)
	}()
	defer func() { ln.Close(); <-done }()

	p := start(t, Config{Targets: []string{ln.Addr().String()}})
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	io.WriteString(c, "hello")
	c.(*net.TCPConn).CloseWrite()
	got, err := io.ReadAll(c)
	if err != nil || string(got) != "hello" {
		t.Errorf("echo through a half-closed connection: %q, %v; want hello", got, err)
	}
}

func TestCloseCutsOpenConnections(t *testing.T) {
	b := newBackend(t, "ok")
	p, err := Listen("127.0.0.1:0", Config{Targets: []string{b.addr()}, Mix: Mix{Stall: 1}, StallFor: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	// One idle connection and one request held by a stall.
	idle, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close()
	errc := make(chan error, 1)
	go func() {
		_, err := get(t, p, time.Hour)
		errc <- err
	}()
	for b.served.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	closed := make(chan error, 1)
	go func() { closed <- p.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Errorf("Close: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Close did not return with a stalled connection open")
	}
	if err := <-errc; err == nil {
		t.Error("the stalled request succeeded after Close")
	}
	if err := p.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, err := net.Dial("tcp", p.Addr()); err == nil {
		t.Error("the proxy still accepts after Close")
	}
}

func TestSeededDraws(t *testing.T) {
	mix := Mix{Reset: 0.2, Drop: 0.2, Latency: 0.2, Stall: 0.2}
	draws := func(seed uint64) []Kind {
		p := start(t, Config{Targets: []string{"127.0.0.1:1"}, Seed: seed, Mix: mix})
		var ks []Kind
		for range 64 {
			ks = append(ks, p.decide().kind)
		}
		return ks
	}
	a, b, c := draws(1), draws(1), draws(2)
	if !slices.Equal(a, b) {
		t.Errorf("seed 1 drew %v then %v: want the same sequence", a, b)
	}
	if slices.Equal(a, c) {
		t.Errorf("seeds 1 and 2 drew the same sequence %v", a)
	}
	for k := range numKinds {
		if !slices.Contains(a, k) {
			t.Errorf("64 draws from %+v never gave %v", mix, k)
		}
	}
}

func TestMixPick(t *testing.T) {
	m := Mix{Reset: 0.1, Drop: 0.2, Latency: 0.3, Stall: 0.1}
	tests := []struct {
		u    float64
		want Kind
	}{
		{0, Reset}, {0.09, Reset}, {0.11, Drop}, {0.29, Drop}, {0.31, Latency},
		{0.59, Latency}, {0.61, Stall}, {0.69, Stall}, {0.71, Pass}, {0.99, Pass},
	}
	for _, tt := range tests {
		if got := m.pick(tt.u); got != tt.want {
			t.Errorf("pick(%v) = %v, want %v", tt.u, got, tt.want)
		}
	}
	if got := (Mix{}).pick(0); got != Pass {
		t.Errorf("zero Mix picked %v, want pass", got)
	}
}

func TestInvalidConfig(t *testing.T) {
	for _, cfg := range []Config{
		{},
		{Targets: []string{"127.0.0.1:1"}, Mix: Mix{Reset: -0.1}},
		{Targets: []string{"127.0.0.1:1"}, Mix: Mix{Reset: 0.6, Drop: 0.6}},
	} {
		if p, err := Listen("127.0.0.1:0", cfg); err == nil {
			p.Close()
			t.Errorf("Listen(%+v) succeeded, want an error", cfg)
		}
	}
	p := start(t, Config{Targets: []string{"127.0.0.1:1"}})
	if err := p.SetMix(Mix{Stall: 2}); err == nil {
		t.Error("SetMix with a probability of 2 succeeded")
	}
}

func TestKindString(t *testing.T) {
	var names []string
	for k := range numKinds + 1 {
		names = append(names, k.String())
	}
	if got, want := strings.Join(names, ","), "pass,latency,reset,drop,stall,kind(5)"; got != want {
		t.Errorf("names %s, want %s", got, want)
	}
}

// echo is a TCP server that answers each chunk it reads with the same
// bytes, and counts the chunks it read.
type echo struct {
	ln   net.Listener
	read atomic.Int64
	wg   sync.WaitGroup
}

func newEcho(t *testing.T, network, addr string) *echo {
	t.Helper()
	ln, err := net.Listen(network, addr)
	if err != nil {
		t.Fatal(err)
	}
	e := &echo{ln: ln}
	e.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			e.wg.Go(func() {
				defer c.Close()
				buf := make([]byte, 1024)
				for {
					n, err := c.Read(buf)
					if err != nil {
						return
					}
					e.read.Add(1)
					if _, err := c.Write(buf[:n]); err != nil {
						return
					}
				}
			})
		}
	})
	t.Cleanup(func() { ln.Close(); e.wg.Wait() })
	return e
}

func (e *echo) addr() string { return e.ln.Addr().String() }

// dialEcho connects to the proxy and checks that one round trip passes.
func dialEcho(t *testing.T, p *Proxy) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if got, err := roundTrip(c, "hello"); err != nil || got != "hello" {
		t.Fatalf("round trip before any fault: %q, %v", got, err)
	}
	return c
}

// roundTrip writes msg on c and reads the answer.
func roundTrip(c net.Conn, msg string) (string, error) {
	if _, err := io.WriteString(c, msg); err != nil {
		return "", err
	}
	buf := make([]byte, len(msg))
	n, err := io.ReadFull(c, buf)
	return string(buf[:n]), err
}

func TestTrap(t *testing.T) {
	tests := []struct {
		name     string
		trap     Trap
		wantErr  error
		wantRead int64 // chunks the server read, the two that passed before the trap included
	}{
		{"reset before the server", Trap{Kind: Reset}, syscall.ECONNRESET, 2},
		{"closed before the server", Trap{Kind: Reset, FIN: true}, io.EOF, 2},
		{"answer dropped, reset", Trap{Kind: Drop}, syscall.ECONNRESET, 3},
		{"answer dropped, closed", Trap{Kind: Drop, FIN: true}, io.EOF, 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEcho(t, "tcp", "127.0.0.1:0")
			p := start(t, Config{Targets: []string{e.addr()}})
			c := dialEcho(t, p)
			tt.trap.Match = func(chunk []byte) bool { return strings.Contains(string(chunk), "charge") }
			sprung, err := p.Arm(tt.trap)
			if err != nil {
				t.Fatal(err)
			}
			if got, err := roundTrip(c, "other"); err != nil || got != "other" {
				t.Fatalf("a chunk the trap does not match: %q, %v; want it through", got, err)
			}
			got, err := roundTrip(c, "charge 1")
			// io.ReadFull reports a clean EOF before any byte as io.EOF.
			if !errors.Is(err, tt.wantErr) {
				t.Errorf("round trip the trap matches: %q, %v; want %v", got, err, tt.wantErr)
			}
			select {
			case <-sprung:
			case <-time.After(10 * time.Second):
				t.Fatal("the trap's channel is not closed after it sprang")
			}
			// The server reads the chunk it is sent before it answers,
			// and the client has its error after that.
			if got := e.read.Load(); got != tt.wantRead {
				t.Errorf("the server read %d chunks, want %d", got, tt.wantRead)
			}
			// Sprung once: the next matching chunk goes through.
			c2 := dialEcho(t, p)
			if got, err := roundTrip(c2, "charge 2"); err != nil || got != "charge 2" {
				t.Errorf("after the trap sprang: %q, %v; want the chunk through", got, err)
			}
		})
	}
}

func TestTrapUnixTarget(t *testing.T) {
	e := newEcho(t, "unix", t.TempDir()+"/echo.sock")
	p := start(t, Config{Targets: []string{e.addr()}})
	c := dialEcho(t, p)
	if _, err := p.Arm(Trap{Kind: Drop, Match: func([]byte) bool { return true }}); err != nil {
		t.Fatal(err)
	}
	if got, err := roundTrip(c, "charge"); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("got %q, %v; want connection reset by peer", got, err)
	}
	if got := e.read.Load(); got != 2 {
		t.Errorf("the server read %d chunks, want 2", got)
	}
}

func TestArmInvalid(t *testing.T) {
	p := start(t, Config{Targets: []string{"127.0.0.1:1"}})
	match := func([]byte) bool { return true }
	for _, tr := range []Trap{{Kind: Reset}, {Kind: Stall, Match: match}, {Kind: Pass, Match: match}} {
		if _, err := p.Arm(tr); err == nil {
			t.Errorf("Arm(%+v) succeeded, want an error", tr)
		}
	}
}

func TestCut(t *testing.T) {
	for _, tt := range []struct {
		fin     bool
		wantErr error
	}{{false, syscall.ECONNRESET}, {true, io.EOF}} {
		t.Run(map[bool]string{false: "reset", true: "fin"}[tt.fin], func(t *testing.T) {
			e := newEcho(t, "tcp", "127.0.0.1:0")
			p := start(t, Config{Targets: []string{e.addr()}})
			a, b := dialEcho(t, p), dialEcho(t, p)
			if n := p.Cut(tt.fin); n != 2 {
				t.Errorf("Cut = %d, want 2 connections cut", n)
			}
			for _, c := range []net.Conn{a, b} {
				if _, err := c.Read(make([]byte, 1)); !errors.Is(err, tt.wantErr) {
					t.Errorf("read on a cut connection: %v, want %v", err, tt.wantErr)
				}
			}
			dialEcho(t, p) // still accepting
		})
	}
}
