package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/failsafe-go/failsafe-go/circuitbreaker"
	"github.com/failsafe-go/failsafe-go/failsafehttp"

	"github.com/idemkit/idem"
)

// Payment is what the router sends to a provider.
type Payment struct {
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
	Customer string `json:"customer"`
}

// Receipt says where a payment was made.
type Receipt struct {
	Provider string // the provider that made it
	Key      string // the idempotency key it was made under
	ID       string `json:"id"`
}

// Provider is one payment API the router can send a payment to. Its
// client's Transport is an idem.Transport whose Base is failsafe-go's
// round tripper with a circuit breaker: the breaker sees every attempt,
// and refuses attempts while it is open.
type Provider struct {
	Name    string
	Client  *idem.Client
	Breaker circuitbreaker.CircuitBreaker[*http.Response]
}

// NewProvider returns a Provider for the API at baseURL, whose attempts go
// through base (nil: http.DefaultTransport). Its breaker opens after three
// attempts in a row fail (an error or a 5xx), for half a minute.
//
// The failsafe-go round tripper has no retry policy of its own: idem
// retries, with the key. That matters: it makes failsafe's "circuit
// breaker open" mean that nothing of the attempt was sent, which the
// refusal below tells idem with idem.ErrNotSent.
func NewProvider(name, baseURL string, base http.RoundTripper, retry idem.RetryPolicy) *Provider {
	if base == nil {
		base = http.DefaultTransport
	}
	breaker := circuitbreaker.NewBuilder[*http.Response]().
		HandleIf(func(resp *http.Response, err error) bool {
			return err != nil || resp.StatusCode >= 500
		}).
		WithFailureThreshold(3).
		WithDelay(30 * time.Second).
		Build()
	tr := &idem.Transport{
		Base:  refusal{name: name, next: failsafehttp.NewRoundTripper(base, breaker)},
		Retry: retry,
	}
	return &Provider{
		Name:    name,
		Client:  &idem.Client{BaseURL: baseURL, HTTPClient: &http.Client{Transport: tr}},
		Breaker: breaker,
	}
}

// refusal marks failsafe-go's circuit breaker refusals with
// idem.ErrNotSent: the breaker refused before anything was sent. (idem
// does not import failsafe-go; this is the one place that knows both.)
type refusal struct {
	name string
	next http.RoundTripper
}

func (r refusal) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := r.next.RoundTrip(req)
	if errors.Is(err, circuitbreaker.ErrOpen) {
		return nil, fmt.Errorf("%w: %s: %w", idem.ErrNotSent, r.name, err)
	}
	return resp, err
}

// Router sends each payment to its Primary provider, and to its Fallback,
// under a new key, only when the payment was not sent to the Primary at
// all. When the Primary's outcome is unknown (the payment may have been
// made there), it sends the payment to the Primary again, with the same
// key, and never to the Fallback: that could charge the customer twice.
type Router struct {
	Primary, Fallback *Provider
	// Rounds is how many times a payment whose outcome is unknown is sent
	// to its provider again, with its key, before Pay gives up with an
	// *UnknownError. Each round is a whole idem call, retries included.
	Rounds int
	// Pause is the wait between rounds.
	Pause time.Duration
}

// UnknownError is returned by Router.Pay when a payment's outcome is
// still unknown after its rounds: it may have been made. Send it again
// later to Provider with Key (and to no other provider) to learn which.
type UnknownError struct {
	Provider, Key string
	Err           error // the last round's
}

func (e *UnknownError) Error() string {
	return fmt.Sprintf("payment at %s with key %s: outcome unknown, send it there again with the same key: %v", e.Provider, e.Key, e.Err)
}

func (e *UnknownError) Unwrap() error { return e.Err }

// Pay makes the payment p at most once: at the Primary, or, if nothing
// reached the Primary, at the Fallback. It returns a Receipt, the
// provider's definite refusal (an *idem.APIError, or an
// *idem.KeyReuseError), an *UnknownError, or the error of a payment that
// reached no provider.
func (r *Router) Pay(ctx context.Context, p Payment) (*Receipt, error) {
	rec, outcome, err := r.settle(ctx, r.Primary, p)
	if outcome != idem.OutcomeNotSent || r.Fallback == nil {
		return rec, err
	}
	// Nothing reached the Primary: the Fallback may take it, under a key
	// of its own.
	rec, _, err2 := r.settle(ctx, r.Fallback, p)
	if rec == nil && err2 != nil {
		err2 = fmt.Errorf("%s: %w (after %s: %w)", r.Fallback.Name, err2, r.Primary.Name, err)
	}
	return rec, err2
}

// settle sends p to prov under a new key until its outcome is known, or
// the rounds run out. Once a round's outcome was unknown, the payment's is
// unknown until a round says done: a later round that is not sent (the
// breaker opened meanwhile) does not make it not sent. A payment made
// whose receipt was lost (an *idem.AnswerLostError: a 2xx whose body was
// cut) is asked for again with its key, as an unknown one is: the
// provider's replay is the receipt.
func (r *Router) settle(ctx context.Context, prov *Provider, p Payment) (*Receipt, idem.Outcome, error) {
	key := idem.NewKey()
	ctx = idem.WithKey(ctx, key)
	unknown := false
	for round := 0; ; round++ {
		rec := Receipt{Provider: prov.Name, Key: key}
		resp, err := prov.Client.Post(ctx, "/v1/payments", p, &rec)
		switch idem.OutcomeOf(resp, err) {
		case idem.OutcomeDone:
			var lost *idem.AnswerLostError
			switch {
			case errors.As(err, &lost):
				unknown = true // paid, without a receipt: ask again for it
			case err != nil:
				return nil, idem.OutcomeDone, err
			default:
				return &rec, idem.OutcomeDone, nil
			}
		case idem.OutcomeNotSent:
			if !unknown {
				return nil, idem.OutcomeNotSent, fmt.Errorf("%s: %w", prov.Name, err)
			}
		case idem.OutcomeUnknown:
			unknown = true
		}
		if round >= r.Rounds {
			return nil, idem.OutcomeUnknown, &UnknownError{Provider: prov.Name, Key: key, Err: err}
		}
		select {
		case <-time.After(r.Pause):
		case <-ctx.Done():
			return nil, idem.OutcomeUnknown, &UnknownError{Provider: prov.Name, Key: key, Err: ctx.Err()}
		}
	}
}
