package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// outcome is the result of one request.
type outcome struct {
	status   int // 0 on a transport error
	replayed bool
	err      error
}

// sample is one measured request.
type sample struct {
	start   time.Time
	latency time.Duration
}

// tally collects the samples and outcomes of one worker, then of a run.
type tally struct {
	samples  []sample
	statuses map[int]int
	replayed int
	errors   int
	firstErr error
}

func newTally() *tally { return &tally{statuses: make(map[int]int)} }

func (t *tally) add(start time.Time, lat time.Duration, o outcome, ok func(outcome) bool) {
	t.samples = append(t.samples, sample{start, lat})
	t.statuses[o.status]++
	if o.replayed {
		t.replayed++
	}
	if !ok(o) {
		t.errors++
		if t.firstErr == nil {
			t.firstErr = o.err
			if t.firstErr == nil {
				t.firstErr = fmt.Errorf("unexpected status %d", o.status)
			}
		}
	}
}

func (t *tally) merge(o *tally) {
	t.samples = append(t.samples, o.samples...)
	for k, v := range o.statuses {
		t.statuses[k] += v
	}
	t.replayed += o.replayed
	t.errors += o.errors
	if t.firstErr == nil {
		t.firstErr = o.firstErr
	}
}

// client sends the payment requests of a scenario.
type client struct {
	http   *http.Client
	base   string // server URL
	path   string // the route
	bearer string
}

func newClient(base, apiKey string, conns int) *client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConns = conns * 2
	tr.MaxIdleConnsPerHost = conns * 2
	tr.DisableCompression = true
	return &client{
		http:   &http.Client{Transport: tr, Timeout: 30 * time.Second},
		base:   base,
		path:   "/v1/payments",
		bearer: "Bearer " + apiKey,
	}
}

func (c *client) close() { c.http.CloseIdleConnections() }

// paymentBody is the body of payment n; the same n gives the same bytes,
// so a key is always replayed with the request it was first sent with.
func paymentBody(n int64) []byte {
	b := make([]byte, 0, 64)
	b = append(b, `{"amount":`...)
	b = strconv.AppendInt(b, 100+n%100000, 10)
	b = append(b, `,"currency":"usd","customer":"cus_`...)
	b = strconv.AppendInt(b, n, 10)
	return append(b, `"}`...)
}

// post sends POST to the route (/v1/payments) with key ("" for none) and reads the answer
// to the end.
func (c *client) post(ctx context.Context, key string, body []byte) outcome {
	return c.postSent(ctx, key, "", body)
}

// postSent is post with a Repeatability-First-Sent header of firstSent
// ("" for none), as idem's Transport sends on every attempt.
func (c *client) postSent(ctx context.Context, key, firstSent string, body []byte) outcome {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+c.path, bytes.NewReader(body))
	if err != nil {
		return outcome{err: err}
	}
	req.Header["Authorization"] = []string{c.bearer}
	req.Header["Content-Type"] = []string{"application/json"}
	if key != "" {
		req.Header["Idempotency-Key"] = []string{key}
	}
	if firstSent != "" {
		req.Header["Repeatability-First-Sent"] = []string{firstSent}
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return outcome{err: err}
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return outcome{
		status:   resp.StatusCode,
		replayed: resp.Header.Get("Idempotent-Replayed") == "true",
		err:      err,
	}
}

// create sends an unkeyed POST of body and returns the id of the row the
// 201 created.
func (c *client) create(ctx context.Context, body []byte) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+c.path, bytes.NewReader(body))
	if err != nil {
		return "", err
	}
	req.Header["Authorization"] = []string{c.bearer}
	req.Header["Content-Type"] = []string{"application/json"}
	resp, err := c.http.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	var out struct {
		ID json.Number `json:"id"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || resp.StatusCode != http.StatusCreated || out.ID == "" {
		return "", fmt.Errorf("status %d, id %q: %v", resp.StatusCode, out.ID, err)
	}
	return out.ID.String(), nil
}

// get sends GET to the route with id appended, and reads the answer to
// the end; its status and the id it read are returned.
func (c *client) get(ctx context.Context, id string) outcome {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.base+c.path+"/"+id, nil)
	if err != nil {
		return outcome{err: err}
	}
	req.Header["Authorization"] = []string{c.bearer}
	resp, err := c.http.Do(req)
	if err != nil {
		return outcome{err: err}
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return outcome{status: resp.StatusCode, err: err}
}

// window is the measured part of a run: requests that start inside it are
// recorded.
type window struct {
	from, to time.Time
}

// drive runs op from n workers from now until w.to, or until max requests
// were measured, and returns the tally of the requests that started within
// w. op gets the worker's number and a sequence number unique in the run.
func drive(ctx context.Context, n int, w window, max int64, op func(ctx context.Context, worker int, seq int64) outcome, ok func(outcome) bool) *tally {
	ctx, cancel := context.WithDeadline(ctx, w.to.Add(30*time.Second)) // bounds a stuck request
	defer cancel()
	var seq, measured atomic.Int64
	tallies := make([]*tally, n)
	var wg sync.WaitGroup
	for i := range n {
		tallies[i] = newTally()
		wg.Go(func() {
			t := tallies[i]
			for ctx.Err() == nil {
				start := time.Now()
				if !start.Before(w.to) || measured.Load() >= max {
					return
				}
				o := op(ctx, i, seq.Add(1))
				if start.Before(w.from) || ctx.Err() != nil {
					continue // warm-up, or cut short by the end of the run
				}
				measured.Add(1)
				t.add(start, time.Since(start), o, ok)
			}
		})
	}
	wg.Wait()
	total := newTally()
	for _, t := range tallies {
		total.merge(t)
	}
	return total
}
