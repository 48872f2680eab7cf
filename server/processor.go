package server

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	mrand "math/rand/v2"
	"net/http"
	"net/url"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/keyheader"
	"github.com/idemkit/idem/server/idempotency"
)

// Processor is a fake card processor: an http.Handler serving
// POST /v1/charges, itself idempotent like a real one. A charge request
// carries an Idempotency-Key and a JSON body {"amount": 4200, "currency":
// "usd", "customer": "cus_123"} (the customer is optional); the first
// request with a key creates the charge (201), every later one gets the
// same charge back (200, Idempotent-Replayed: true), and one with another
// amount or currency gets 422. Charges are kept in a [ChargeStore], so
// exactly one charge exists per key however often and however concurrently
// it is asked for. GET /v1/charges?idempotency_key=K returns the charge
// made under K (200), or 404: a real processor's search of its charges by
// their metadata, which is how the payments API's sweeper finds the
// charge of an abandoned operation without making one.
//
// It can be slowed down ([Processor.Delay]) and made to fail, to exercise
// the payments API's retries and crash recovery: [Processor.FailNext] and
// [Processor.FailureRate] answer 503 before anything is charged (a 503 from
// it always means nothing was charged), and [Processor.LoseNext] charges and
// then cuts the connection, as if the answer were lost on the way back.
//
// Set the exported fields before serving; the methods are safe for
// concurrent use.
type Processor struct {
	// Charges keeps the charges. It must not be nil.
	Charges ChargeStore
	// Delay is how long each charge request takes before it is answered,
	// to model processor latency. Zero: no delay.
	Delay time.Duration
	// FailureRate is the share of charge requests, in [0, 1], answered 503
	// at random before anything is charged. Zero: none.
	FailureRate float64
	// Logger receives one record per charge request. If nil, slog.Default
	// is used.
	Logger *slog.Logger

	metrics  *Metrics
	failNext atomic.Int64
	loseNext atomic.Int64
}

// FailNext makes the next n charge requests fail with 503 before anything
// is charged.
func (p *Processor) FailNext(n int) { p.failNext.Store(int64(n)) }

// LoseNext makes the next n charge requests charge (or find their charge)
// and then cut the connection instead of answering, so the caller cannot
// tell whether it was charged and must retry with the same key.
func (p *Processor) LoseNext(n int) { p.loseNext.Store(int64(n)) }

// take decrements a failure counter and reports whether it was positive.
func take(n *atomic.Int64) bool {
	for {
		v := n.Load()
		if v <= 0 {
			return false
		}
		if n.CompareAndSwap(v, v-1) {
			return true
		}
	}
}

func (p *Processor) observe(result string) {
	if p.metrics != nil {
		p.metrics.observeCharge(result)
	}
}

// chargeRequest is the body of POST /v1/charges.
type chargeRequest struct {
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
	Customer string `json:"customer,omitempty"`
}

// chargeResponse is the processor's answer for a charge.
type chargeResponse struct {
	ID       string    `json:"id"`
	Amount   int64     `json:"amount"`
	Currency string    `json:"currency"`
	Customer string    `json:"customer,omitempty"`
	Created  time.Time `json:"created"`
}

func chargeOf(c Charge) chargeResponse {
	return chargeResponse{c.ID, c.Amount, c.Currency, c.Customer, c.CreatedAt}
}

// ServeHTTP serves POST /v1/charges and GET /v1/charges?idempotency_key=K;
// any other request gets 404 or 405.
func (p *Processor) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/v1/charges" {
		writeProblem(w, r, ProblemNotFound, http.StatusNotFound, "The processor serves only POST and GET /v1/charges.")
		return
	}
	log := p.Logger
	if log == nil {
		log = slog.Default()
	}
	if r.Method == http.MethodGet {
		p.find(w, r, log)
		return
	}
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", "GET, POST")
		writeProblem(w, r, ProblemMethodNotAllowed, http.StatusMethodNotAllowed, "Create charges with POST /v1/charges.")
		return
	}
	key, err := keyheader.Parse(r.Header.Values("Idempotency-Key"))
	if err != nil {
		p.observe("rejected")
		writeProblem(w, r, idempotency.ProblemKeyInvalid, http.StatusBadRequest, "Send each charge with a valid Idempotency-Key: "+err.Error()+".")
		return
	}
	var req chargeRequest
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<16)).Decode(&req); err != nil || req.Amount <= 0 || req.Currency == "" {
		p.observe("rejected")
		writeProblem(w, r, idempotency.ProblemInvalidRequest, http.StatusBadRequest, `Send {"amount": <positive integer>, "currency": "<iso code>"}.`)
		return
	}
	if p.Delay > 0 {
		t := time.NewTimer(p.Delay)
		select {
		case <-r.Context().Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
	if take(&p.failNext) || (p.FailureRate > 0 && mrand.Float64() < p.FailureRate) {
		p.observe("failed")
		log.Info("processor: injected failure", "key", key)
		w.Header().Set("Retry-After", "0")
		writeProblem(w, r, ProblemProcessorUnavailable, http.StatusServiceUnavailable, "Injected failure: nothing was charged. Retry with the same key.")
		return
	}
	charge, created, err := p.Charges.CreateCharge(r.Context(), Charge{
		ID:             "ch_" + rand.Text(),
		IdempotencyKey: key,
		Amount:         req.Amount,
		Currency:       req.Currency,
		Customer:       req.Customer,
		CreatedAt:      time.Now().UTC().Truncate(time.Microsecond),
	})
	if err != nil {
		p.observe("failed")
		log.Error("processor: storing the charge failed", "key", key, "err", err)
		writeProblem(w, r, idempotency.ProblemInternal, http.StatusInternalServerError, "The charge could not be stored. Retry with the same key.")
		return
	}
	if charge.Amount != req.Amount || charge.Currency != req.Currency {
		p.observe("mismatch")
		writeProblem(w, r, idempotency.ProblemKeyMismatch, http.StatusUnprocessableEntity, fmt.Sprintf(
			"Charge %s was created with this key for another amount or currency. Use a new key for a new charge.", charge.ID))
		return
	}
	if take(&p.loseNext) {
		p.observe("lost")
		log.Info("processor: injected lost answer", "key", key, "charge", charge.ID)
		panic(http.ErrAbortHandler)
	}
	status := http.StatusOK
	if created {
		p.observe("created")
		status = http.StatusCreated
	} else {
		p.observe("replayed")
		w.Header().Set("Idempotent-Replayed", "true")
	}
	log.Debug("processor: charge", "key", key, "charge", charge.ID, "created", created)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(chargeOf(charge))
}

// find serves GET /v1/charges?idempotency_key=K: the charge made under K,
// or 404.
func (p *Processor) find(w http.ResponseWriter, r *http.Request, log *slog.Logger) {
	key := r.URL.Query().Get("idempotency_key")
	if key == "" {
		writeProblem(w, r, idempotency.ProblemInvalidRequest, http.StatusBadRequest, "Name the charge: GET /v1/charges?idempotency_key=<the key it was made with>.")
		return
	}
	charge, err := p.Charges.ChargeByKey(r.Context(), key)
	switch {
	case errors.Is(err, ErrNotFound):
		writeProblem(w, r, ProblemNotFound, http.StatusNotFound, "No charge was made with this idempotency key.")
		return
	case err != nil:
		log.Error("processor: reading a charge failed", "key", key, "err", err)
		writeProblem(w, r, idempotency.ProblemInternal, http.StatusInternalServerError, "The charge could not be read. Retry.")
		return
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(chargeOf(charge))
}

// Errors of processorClient.charge.
var (
	// errProcessorDeclined: the processor answered with a definitive
	// failure; nothing was charged.
	errProcessorDeclined = errors.New("processor refused the charge")
	// errProcessorConflict: the processor holds a charge for this key with
	// other parameters.
	errProcessorConflict = errors.New("processor holds another charge for this key")
	// errNoCharge: the processor holds no charge for this key.
	errNoCharge = errors.New("processor holds no charge for this key")
)

// processorClient calls a [Processor] over HTTP through the SDK's
// [idem.Transport], which retries with the same Idempotency-Key.
type processorClient struct {
	url    string // base URL; the client posts to url + "/v1/charges"
	client *http.Client
}

// defaultProcessorRetry is the retry policy towards the processor unless
// [Config.ProcessorRetry] says otherwise: quick retries, bounded well below
// the default lock timeout.
var defaultProcessorRetry = idem.RetryPolicy{
	MaxAttempts:     5,
	InitialInterval: 20 * time.Millisecond,
	MaxInterval:     500 * time.Millisecond,
	MaxElapsedTime:  20 * time.Second,
}

func newProcessorClient(baseURL string, retry idem.RetryPolicy, log *slog.Logger) *processorClient {
	if retry == (idem.RetryPolicy{}) {
		retry = defaultProcessorRetry
	}
	return &processorClient{
		url: baseURL,
		client: &http.Client{Transport: &idem.Transport{
			Base:          &http.Transport{MaxIdleConnsPerHost: 64, IdleConnTimeout: 30 * time.Second},
			Retry:         retry,
			DisableBudget: true, // one in-process caller: the payments API's own retries are bounded
			Logger:        log,
		}},
	}
}

// charge charges amount in currency under the idempotency key. It returns
// the charge, or errProcessorDeclined (nothing was charged),
// errProcessorConflict, or another error when the outcome is unknown.
func (c *processorClient) charge(ctx context.Context, key string, amount int64, currency, customer string) (chargeResponse, error) {
	body, _ := json.Marshal(chargeRequest{Amount: amount, Currency: currency, Customer: customer})
	req, err := http.NewRequestWithContext(idem.WithKey(ctx, key), http.MethodPost, c.url+"/v1/charges", bytes.NewReader(body))
	if err != nil {
		return chargeResponse{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.client.Do(req)
	if err != nil {
		if reuse := (*idem.KeyReuseError)(nil); errors.As(err, &reuse) {
			return chargeResponse{}, errProcessorConflict
		}
		return chargeResponse{}, err
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusOK || resp.StatusCode == http.StatusCreated:
		var ch chargeResponse
		if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<16)).Decode(&ch); err != nil {
			return chargeResponse{}, fmt.Errorf("processor: decoding the charge: %w", err)
		}
		return ch, nil
	case resp.StatusCode == http.StatusServiceUnavailable || (resp.StatusCode >= 400 && resp.StatusCode < 500):
		io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
		return chargeResponse{}, fmt.Errorf("%w: %s", errProcessorDeclined, resp.Status)
	default:
		io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
		return chargeResponse{}, fmt.Errorf("processor: unexpected answer %s", resp.Status)
	}
}

// find returns the charge made under the idempotency key, errNoCharge when
// there is none, or another error when the processor could not tell.
func (c *processorClient) find(ctx context.Context, key string) (chargeResponse, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.url+"/v1/charges?"+url.Values{"idempotency_key": {key}}.Encode(), nil)
	if err != nil {
		return chargeResponse{}, err
	}
	resp, err := c.client.Do(req)
	if err != nil {
		return chargeResponse{}, err
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
		var ch chargeResponse
		if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<16)).Decode(&ch); err != nil {
			return chargeResponse{}, fmt.Errorf("processor: decoding the charge: %w", err)
		}
		return ch, nil
	case http.StatusNotFound:
		return chargeResponse{}, errNoCharge
	}
	io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
	return chargeResponse{}, fmt.Errorf("processor: unexpected answer %s to a charge lookup", resp.Status)
}

// close releases the client's idle connections.
func (c *processorClient) close() { c.client.CloseIdleConnections() }
