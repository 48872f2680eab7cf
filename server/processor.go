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
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/keyheader"
	"github.com/idemkit/idem/server/idempotency"
)

// Processor is a fake card processor: an http.Handler serving
// POST /v1/charges, itself idempotent like a real one. A charge request
// carries an Idempotency-Key and a JSON body {"amount": 4200, "currency":
// "usd"}; the first request with a key creates the charge (201), every later
// one gets the same charge back (200, Idempotent-Replayed: true), and one
// with another amount or currency gets 422. Charges are kept in a
// [ChargeStore], so exactly one charge exists per key however often and
// however concurrently it is asked for.
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
}

// chargeResponse is the processor's answer for a charge.
type chargeResponse struct {
	ID       string    `json:"id"`
	Amount   int64     `json:"amount"`
	Currency string    `json:"currency"`
	Created  time.Time `json:"created"`
}

// ServeHTTP serves POST /v1/charges; any other request gets 404 or 405.
func (p *Processor) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/v1/charges" {
		writeProblem(w, r, ProblemNotFound, http.StatusNotFound, "The processor serves only POST /v1/charges.")
		return
	}
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		writeProblem(w, r, ProblemMethodNotAllowed, http.StatusMethodNotAllowed, "Create charges with POST /v1/charges.")
		return
	}
	log := p.Logger
	if log == nil {
		log = slog.Default()
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
	json.NewEncoder(w).Encode(chargeResponse{charge.ID, charge.Amount, charge.Currency, charge.CreatedAt})
}

// Errors of processorClient.charge.
var (
	// errProcessorDeclined: the processor answered with a definitive
	// failure; nothing was charged.
	errProcessorDeclined = errors.New("processor refused the charge")
	// errProcessorConflict: the processor holds a charge for this key with
	// other parameters.
	errProcessorConflict = errors.New("processor holds another charge for this key")
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
func (c *processorClient) charge(ctx context.Context, key string, amount int64, currency string) (chargeResponse, error) {
	body, _ := json.Marshal(chargeRequest{Amount: amount, Currency: currency})
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

// close releases the client's idle connections.
func (c *processorClient) close() { c.client.CloseIdleConnections() }
