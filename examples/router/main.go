// Command router is a payment router that fails a payment over to a second
// provider only when nothing of it reached the first, as idem.OutcomeOf
// tells after each call.
//
//	go run .   (in examples/router, a module of its own: failsafe-go stays
//	            out of idem's dependencies)
//
// Each provider's idem.Transport sends its attempts through failsafe-go's
// round tripper with a circuit breaker. The router sends a payment to the
// primary provider under a new key, and then:
//
//   - not sent (a refused connection, an open breaker): to the fallback,
//     at once, under a key of its own;
//   - done: that is the answer, a payment or a refusal;
//   - unknown (the primary may have made it: an answer cut off, a 5xx):
//     to the primary again, with the same key, a few rounds; never to the
//     fallback, which could charge the customer twice.
//
// It runs six stories against two in-process providers on 127.0.0.1 and
// prints where each payment was made. In the last, the primary is down:
// no attempt writes its headers, which idem learns from net/http's trace
// (failsafe-go's round tripper passes the request's context on), so the
// payment was not sent and fails over at once; the next one is refused by
// the breaker, open by then, and fails over too.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/idemkit/idem"
)

func main() {
	if err := run(context.Background(), os.Stdout); err != nil {
		log.Fatal(err)
	}
}

// fast keeps the stories short: real waits, small ones.
var fast = idem.RetryPolicy{InitialInterval: 5 * time.Millisecond, MaxInterval: 20 * time.Millisecond}

// story is one run of the router against fresh providers: setup prepares
// the primary provider and returns its URL, and a change to make to its
// Provider, if any; then the router makes payments payments, one after
// the other.
type story struct {
	name     string
	payments int
	setup    func(primary *fakeProvider) (url string, change func(*Provider))
}

var stories = []story{
	{"both providers up", 1, func(primary *fakeProvider) (string, func(*Provider)) {
		return primary.URL(), nil
	}},
	{"the primary's circuit breaker is open", 1, func(primary *fakeProvider) (string, func(*Provider)) {
		return primary.URL(), func(p *Provider) { p.Breaker.Open() }
	}},
	{"the primary makes the payment, then cuts its answer, twice", 1, func(primary *fakeProvider) (string, func(*Provider)) {
		primary.cutting(2)
		return primary.URL(), nil
	}},
	{"the primary makes the payment, then cuts its receipt mid-way", 1, func(primary *fakeProvider) (string, func(*Provider)) {
		primary.cuttingBodies(1)
		return primary.URL(), nil
	}},
	{"the primary makes the payment, then cuts every answer", 1, func(primary *fakeProvider) (string, func(*Provider)) {
		primary.cutting(1 << 30)
		return primary.URL(), nil
	}},
	{"the primary is down (its port is closed)", 2, func(*fakeProvider) (string, func(*Provider)) {
		return closedPort(), nil
	}},
}

// closedPort returns the URL of a port on 127.0.0.1 that nothing listens on.
func closedPort() string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	ln.Close()
	return "http://" + ln.Addr().String()
}

func run(ctx context.Context, w io.Writer) error {
	for i, s := range stories {
		fmt.Fprintf(w, "%d. %s\n", i+1, s.name)
		if err := tell(ctx, w, s); err != nil {
			return err
		}
	}
	return nil
}

// tell runs a story and prints where each payment went.
func tell(ctx context.Context, w io.Writer, s story) error {
	primary, fallback := newFakeProvider("primary"), newFakeProvider("fallback")
	defer primary.Close()
	defer fallback.Close()
	base := &http.Transport{}
	defer base.CloseIdleConnections()
	url, change := s.setup(primary)
	p := NewProvider("primary", url, base, fast)
	if change != nil {
		change(p)
	}
	r := &Router{Primary: p, Fallback: NewProvider("fallback", fallback.URL(), base, fast), Rounds: 2, Pause: 10 * time.Millisecond}
	for range s.payments {
		rec, err := r.Pay(ctx, Payment{Amount: 4200, Currency: "usd", Customer: "cus_123"})
		var unknown *UnknownError
		switch {
		case errors.As(err, &unknown):
			fmt.Fprintf(w, "   outcome unknown: kept to send again to %s with key %s\n", unknown.Provider, unknown.Key)
		case err != nil:
			fmt.Fprintf(w, "   not paid: %v\n", err)
		default:
			fmt.Fprintf(w, "   paid at %s\n", rec.Provider)
		}
	}
	pp, pr := primary.made()
	fp, _ := fallback.made()
	fmt.Fprintf(w, "   payments made: primary %d (%d requests), fallback %d\n", pp, pr, fp)
	if pp+fp > s.payments {
		return fmt.Errorf("story %q: %d payments made for %d", s.name, pp+fp, s.payments)
	}
	return nil
}
