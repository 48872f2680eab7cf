// Package faultproxy is a fault-injecting TCP proxy for reliability tests:
// it sits between HTTP clients and one or more server replicas on loopback
// and, for each connection, decides by a seeded random draw to pass it
// through, slow it down, reset it before the request reaches a server, or
// let the request through and lose the answer once the server has sent it.
//
//	p, err := faultproxy.Listen("127.0.0.1:0", faultproxy.Config{
//		Targets: []string{replicaA, replicaB},
//		Seed:    1,
//		Mix:     faultproxy.Mix{Reset: 0.05, Drop: 0.05, Latency: 0.1, Stall: 0.02},
//	})
//	defer p.Close()
//	// point the clients at "http://" + p.Addr()
//
// Faults are decided per connection, not per request: clients that want one
// decision per HTTP request disable keep-alives. The proxy works at the TCP
// level and knows nothing of HTTP beyond "the first bytes from the server are
// its answer": a [Drop] or [Stall] therefore hits the first answer on the
// connection.
//
// Tests that must cut a connection at one precise point of a conversation,
// rather than at random, arm a [Trap] on the proxy, or [Proxy.Cut] every
// open connection at once.
//
// It exists because github.com/Shopify/toxiproxy/v2, the usual choice,
// proxies one upstream per proxy (no round-robin across replicas), decides
// toxics by unseeded randomness, has no "lose the answer after the server
// sent it" toxic, and as a library brings in about fifteen modules (gorilla
// mux, zerolog, an old prometheus client, tomb) for what fits in one file.
package faultproxy

import (
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Kind is what the proxy does to one connection.
type Kind int

// The kinds of fault, and Pass for none.
const (
	// Pass forwards the connection untouched.
	Pass Kind = iota
	// Latency delays every chunk of data, both ways, by one random delay
	// in (0, Config.MaxLatency].
	Latency
	// Reset resets the client's connection (RST) before anything reaches a
	// server: the request was certainly not processed, but the client
	// cannot know that.
	Reset
	// Drop forwards the request, waits for the server's first bytes of
	// answer, and then resets the client's connection without forwarding
	// them: the server has processed (and committed) the request, and the
	// client never learns it. The classic "lost response after commit".
	Drop
	// Stall forwards the request and holds the server's answer for
	// Config.StallFor before resetting the client: the client's attempt
	// times out while the server has already answered.
	Stall

	numKinds
)

var kindNames = [numKinds]string{"pass", "latency", "reset", "drop", "stall"}

// String returns the kind's name: pass, latency, reset, drop or stall.
func (k Kind) String() string {
	if k >= 0 && k < numKinds {
		return kindNames[k]
	}
	return fmt.Sprintf("kind(%d)", int(k))
}

// Mix gives the probability of each fault for a new connection; whatever
// they leave of 1 is the probability of [Pass]. The zero Mix injects
// nothing.
type Mix struct {
	Reset, Drop, Latency, Stall float64
}

// Valid reports an error when a probability is outside [0, 1] or when
// they add up to more than 1.
func (m Mix) Valid() error {
	for _, p := range []float64{m.Reset, m.Drop, m.Latency, m.Stall} {
		if p < 0 || p > 1 {
			return fmt.Errorf("faultproxy: probability %v outside [0, 1]", p)
		}
	}
	if s := m.Reset + m.Drop + m.Latency + m.Stall; s > 1 {
		return fmt.Errorf("faultproxy: probabilities add up to %v, more than 1", s)
	}
	return nil
}

// pick maps a uniform draw in [0, 1) to a kind.
func (m Mix) pick(u float64) Kind {
	acc := 0.0
	for _, c := range []struct {
		p float64
		k Kind
	}{{m.Reset, Reset}, {m.Drop, Drop}, {m.Latency, Latency}, {m.Stall, Stall}} {
		acc += c.p
		if u < acc {
			return c.k
		}
	}
	return Pass
}

// Defaults of [Config].
const (
	DefaultMaxLatency  = 50 * time.Millisecond
	DefaultStallFor    = 5 * time.Second
	DefaultDialTimeout = time.Second
)

// Config configures a [Proxy].
type Config struct {
	// Targets are the upstream addresses: host:port, or the path of a
	// Unix socket (any target that starts with a slash, such as
	// "/tmp/.s.PGSQL.5432"). Connections go to them in turn
	// (round-robin); when one cannot be dialled, the next ones are tried,
	// as a load balancer does. At least one is required.
	Targets []string
	// Seed seeds the draws that choose each connection's fault and delay:
	// the n-th connection accepted gets the same fault in every run with
	// the same seed and mix.
	Seed uint64
	// Mix is the initial fault mix; see [Proxy.SetMix].
	Mix Mix
	// MaxLatency bounds the delay of a [Latency] connection. Defaults to
	// DefaultMaxLatency.
	MaxLatency time.Duration
	// StallFor is how long a [Stall] connection holds the answer before
	// resetting the client. Choose it longer than the clients' attempt
	// timeout. Defaults to DefaultStallFor.
	StallFor time.Duration
	// DialTimeout bounds each dial of a target. Defaults to
	// DefaultDialTimeout.
	DialTimeout time.Duration
}

// Stats counts what a [Proxy] did.
type Stats struct {
	Connections int64            // connections accepted
	Faults      map[Kind]int64   // connections by the kind drawn for them, Pass included
	Failovers   int64            // dials that failed and moved on to the next target
	Unreachable int64            // connections reset because no target could be dialled
	ByTarget    map[string]int64 // connections forwarded, by target address
}

// Proxy is a running fault-injecting proxy. Its methods are safe for
// concurrent use. Close it to stop it.
type Proxy struct {
	ln   net.Listener
	cfg  Config
	done chan struct{}
	wg   sync.WaitGroup

	mu      sync.Mutex
	rng     *rand.Rand
	mix     Mix
	targets []string
	next    int
	conns   map[net.Conn]bool // open connections: true for a client's, false for a target's
	closed  bool
	stats   Stats

	trap atomic.Pointer[armed] // armed by Arm, not yet sprung

	closeOnce sync.Once
}

// Listen starts a proxy on addr (use "127.0.0.1:0" for a free loopback
// port) that forwards to cfg.Targets.
func Listen(addr string, cfg Config) (*Proxy, error) {
	if len(cfg.Targets) == 0 {
		return nil, errors.New("faultproxy: no targets")
	}
	if err := cfg.Mix.Valid(); err != nil {
		return nil, err
	}
	if cfg.MaxLatency <= 0 {
		cfg.MaxLatency = DefaultMaxLatency
	}
	if cfg.StallFor <= 0 {
		cfg.StallFor = DefaultStallFor
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = DefaultDialTimeout
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	p := &Proxy{
		ln:      ln,
		cfg:     cfg,
		done:    make(chan struct{}),
		rng:     rand.New(rand.NewPCG(cfg.Seed, 0x9e3779b97f4a7c15)),
		mix:     cfg.Mix,
		targets: append([]string(nil), cfg.Targets...),
		conns:   make(map[net.Conn]bool),
		stats:   Stats{Faults: make(map[Kind]int64), ByTarget: make(map[string]int64)},
	}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr returns the address the proxy listens on.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// SetMix changes the fault mix for connections accepted from now on;
// connections already open keep their fault. A zero Mix turns faults off.
func (p *Proxy) SetMix(m Mix) error {
	if err := m.Valid(); err != nil {
		return err
	}
	p.mu.Lock()
	p.mix = m
	p.mu.Unlock()
	return nil
}

// SetTarget replaces the address of target i, for a replica that came back
// on another port.
func (p *Proxy) SetTarget(i int, addr string) {
	p.mu.Lock()
	p.targets[i] = addr
	p.mu.Unlock()
}

// Stats returns a copy of the counters.
func (p *Proxy) Stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.stats
	s.Faults = make(map[Kind]int64, len(p.stats.Faults))
	for k, v := range p.stats.Faults {
		s.Faults[k] = v
	}
	s.ByTarget = make(map[string]int64, len(p.stats.ByTarget))
	for k, v := range p.stats.ByTarget {
		s.ByTarget[k] = v
	}
	return s
}

// Close stops accepting, cuts every open connection and waits until every
// goroutine of the proxy has returned.
func (p *Proxy) Close() error {
	var err error
	p.closeOnce.Do(func() {
		close(p.done)
		err = p.ln.Close()
		p.mu.Lock()
		p.closed = true
		for c := range p.conns {
			c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return err
}

// Cut cuts every connection open through the proxy at once, as a network
// failure would: each client's connection is reset (with fin, closed with a
// FIN instead, so the client reads EOF) and each target's closed. The proxy
// goes on accepting new connections. Cut returns how many clients'
// connections it cut.
func (p *Proxy) Cut(fin bool) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	// Clients first: a target's connection closed first would have its
	// client's closed with a FIN by the goroutines that serve them.
	n := 0
	for c, client := range p.conns {
		switch {
		case !client:
		case fin:
			c.Close()
			n++
		default:
			reset(c)
			n++
		}
	}
	for c, client := range p.conns {
		if !client {
			c.Close()
		}
	}
	return n
}

// A Trap is a fault armed on demand with [Proxy.Arm], for a test that must
// cut a connection at one precise point of a conversation: it springs on the
// first chunk of data from a client that Match accepts, on whichever
// connection carries it, and is then disarmed. Connections the trap does not
// spring on get the fault drawn for them as usual.
type Trap struct {
	// Match reports whether a chunk of data from a client springs the
	// trap. A chunk is what one read returned: on loopback, usually one
	// write of the client. Match may be called by many connections at
	// once.
	Match func(chunk []byte) bool
	// Kind is what the trap does to the connection, one of
	//   - [Reset]: the chunk is not forwarded, and the client's connection
	//     is cut: the client has sent its request, and the server never
	//     sees it;
	//   - [Drop]: the chunk is forwarded, and once the target's first
	//     bytes of answer arrive the client's connection is cut without
	//     them: the server has processed the request, and the client never
	//     learns it.
	// The target's connection is closed either way.
	Kind Kind
	// FIN cuts the client's connection with a FIN, so that the client
	// reads EOF, rather than with an RST (connection reset by peer).
	FIN bool
}

// armed is a Trap armed on a proxy; sprung is closed once it has cut a
// connection.
type armed struct {
	Trap
	sprung chan struct{}
}

// Arm arms t, replacing the trap armed before, if it has not sprung. The
// returned channel is closed once t has cut a connection. Arm returns an
// error when t has no Match or a Kind other than [Reset] or [Drop].
func (p *Proxy) Arm(t Trap) (<-chan struct{}, error) {
	if t.Match == nil {
		return nil, errors.New("faultproxy: trap without Match")
	}
	if t.Kind != Reset && t.Kind != Drop {
		return nil, fmt.Errorf("faultproxy: trap of kind %v, want reset or drop", t.Kind)
	}
	a := &armed{Trap: t, sprung: make(chan struct{})}
	p.trap.Store(a)
	return a.sprung, nil
}

// spring returns the armed trap that chunk springs, and disarms it; nil
// when there is none.
func (p *Proxy) spring(chunk []byte) *armed {
	a := p.trap.Load()
	if a == nil || !a.Match(chunk) || !p.trap.CompareAndSwap(a, nil) {
		return nil
	}
	return a
}

// cut cuts the client's connection c as the trap says.
func (a *armed) cut(c net.Conn) {
	if a.FIN {
		c.Close()
	} else {
		reset(c)
	}
	close(a.sprung)
}

// track registers c, a client's connection or a target's, to be closed by
// Close and Cut; it reports false (and closes c) when the proxy is already
// closed.
func (p *Proxy) track(c net.Conn, client bool) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		c.Close()
		return false
	}
	p.conns[c] = client
	return true
}

func (p *Proxy) untrack(c net.Conn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
	c.Close()
}

// plan is the decision for one connection.
type plan struct {
	kind    Kind
	delay   time.Duration // for Latency
	targets []string      // in the order to try
}

func (p *Proxy) decide() plan {
	p.mu.Lock()
	defer p.mu.Unlock()
	pl := plan{kind: p.mix.pick(p.rng.Float64())}
	// Draw the delay for every connection, so that the sequence of draws
	// does not depend on the kinds drawn.
	pl.delay = time.Duration(1 + p.rng.Int64N(int64(p.cfg.MaxLatency)))
	n := len(p.targets)
	pl.targets = make([]string, n)
	for i := range n {
		pl.targets[i] = p.targets[(p.next+i)%n]
	}
	p.next = (p.next + 1) % n
	p.stats.Connections++
	p.stats.Faults[pl.kind]++
	return pl
}

func (p *Proxy) count(f func(*Stats)) {
	p.mu.Lock()
	f(&p.stats)
	p.mu.Unlock()
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			select {
			case <-p.done:
				return
			default:
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			// A temporary failure such as EMFILE: wait a little, as
			// net/http's Server does, unless the proxy is closing.
			select {
			case <-p.done:
				return
			case <-time.After(10 * time.Millisecond):
			}
			continue
		}
		if !p.track(c, true) {
			continue
		}
		pl := p.decide()
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			defer p.untrack(c)
			p.serve(c, pl)
		}()
	}
}

// reset closes c with an RST instead of a FIN, so the peer sees
// "connection reset by peer".
func reset(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	c.Close()
}

// sleep waits d or until the proxy closes; it reports whether it waited d.
func (p *Proxy) sleep(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-p.done:
		return false
	}
}

func (p *Proxy) dial(targets []string) net.Conn {
	d := net.Dialer{Timeout: p.cfg.DialTimeout}
	for i, t := range targets {
		network := "tcp"
		if strings.HasPrefix(t, "/") {
			network = "unix"
		}
		up, err := d.Dial(network, t)
		if err == nil {
			p.count(func(s *Stats) { s.ByTarget[t]++ })
			return up
		}
		if i < len(targets)-1 {
			p.count(func(s *Stats) { s.Failovers++ })
		}
	}
	p.count(func(s *Stats) { s.Unreachable++ })
	return nil
}

func (p *Proxy) serve(client net.Conn, pl plan) {
	if pl.kind == Reset {
		reset(client)
		return
	}
	up := p.dial(pl.targets)
	if up == nil {
		reset(client)
		return
	}
	if !p.track(up, false) {
		reset(client)
		return
	}
	defer p.untrack(up)

	var delay time.Duration
	if pl.kind == Latency {
		delay = pl.delay
	}
	// Requests flow in a goroutine of their own; answers in this one. The
	// end of the requests (the client's FIN) is passed on as a half-close,
	// so the server still answers; the end of the answers, or an error
	// either way, closes both connections, which ends the other direction.
	// A Drop trap sprung by a request is handed to the answers in dropping.
	var dropping atomic.Pointer[armed]
	reqDone := make(chan struct{})
	go func() {
		defer close(reqDone)
		request := func(chunk []byte) bool {
			switch a := p.spring(chunk); {
			case a == nil:
			case a.Kind == Drop:
				dropping.Store(a)
			default: // Reset
				a.cut(client)
				return false
			}
			return true
		}
		if p.copy(up, client, delay, request) == errEOF {
			if hc, ok := up.(interface{ CloseWrite() error }); ok {
				_ = hc.CloseWrite()
				return
			}
		}
		up.Close()
		client.Close()
	}()
	var first func() bool
	switch pl.kind {
	case Drop:
		first = func() bool { return false }
	case Stall:
		first = func() bool {
			t := time.NewTimer(p.cfg.StallFor)
			defer t.Stop()
			select {
			case <-t.C:
			case <-p.done:
			case <-reqDone: // the client gave up first
			}
			return false
		}
	}
	var trapped *armed
	answer := func([]byte) bool {
		if trapped = dropping.Swap(nil); trapped != nil {
			return false
		}
		if f := first; f != nil {
			first = nil
			return f()
		}
		return true
	}
	if p.copy(client, up, delay, answer) == errHeld {
		if trapped != nil {
			trapped.cut(client)
		} else {
			reset(client)
		}
	}
	up.Close()
	client.Close()
	<-reqDone
}

// Outcomes of copy.
var (
	errEOF    = errors.New("source ended")
	errHeld   = errors.New("data held back")
	errBroken = errors.New("connection broken")
)

// copy copies src to dst, waiting delay before each chunk. Before each
// chunk it calls forward; when forward returns false, copy stops without
// writing the chunk and returns errHeld. It returns errEOF when src ended
// cleanly and errBroken on any other error (or when the proxy closes).
func (p *Proxy) copy(dst io.Writer, src io.Reader, delay time.Duration, forward func(chunk []byte) bool) error {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if !forward(buf[:n]) {
				return errHeld
			}
			if delay > 0 && !p.sleep(delay) {
				return errBroken
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return errBroken
			}
		}
		switch {
		case err == io.EOF:
			return errEOF
		case err != nil:
			return errBroken
		}
	}
}
