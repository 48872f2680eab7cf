package main

// The failover test's reconciliation: the payments told and lost with an
// asynchronous primary, sent again as a reconciling client would.

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/idemkit/idem"
)

// told returns the operations whose client was told their payment and
// whose payment the database does not hold.
func told(ops []*op, state dbState) []*op {
	paid := make(map[string]bool, len(state.payments))
	for _, p := range state.payments {
		paid[p.customer] = true
	}
	var gone []*op
	for _, o := range ops {
		if o.state == succeeded && !paid[o.customer] {
			gone = append(gone, o)
		}
	}
	return gone
}

// reconcile sends again, once the clients are done, every operation of
// gone whose client was told its payment and the API now answers 404 for
// it, with its key and first-sent time pinned, as a client reconciling
// its records after a failover would. The key's row was lost with the
// payment: the retry begins the operation again under the operation ID
// derived from the same client, key, request and first-sent time, so the
// processor answers with the charge it holds, and the payment is written
// again with the ID and charge the client was told.
func (cl *clients) reconcile(ctx context.Context, c *chaos, baseURL string, gone []*op) reconcileStats {
	base := &http.Transport{}
	defer base.CloseIdleConnections()
	hc := &http.Client{Transport: &idem.Transport{Base: base}}
	api := make([]*idem.Client, len(cl.accounts))
	for i, a := range cl.accounts {
		api[i] = &idem.Client{BaseURL: baseURL, Token: a.token, HTTPClient: hc}
	}
	var (
		mu       sync.Mutex
		rs       reconcileStats
		problems []string
		next     atomic.Int64
		workers  sync.WaitGroup
	)
	for range cl.cfg.clients {
		workers.Go(func() {
			for i := int(next.Add(1)) - 1; i < len(gone); i = int(next.Add(1)) - 1 {
				gotGone, restored, problem := resend(ctx, api[slices.Index(cl.accounts, gone[i].account)], gone[i])
				mu.Lock()
				if gotGone {
					rs.gone++
				}
				switch {
				case restored:
					rs.restored++
				case problem != "":
					rs.other++
					problems = append(problems, problem)
				}
				mu.Unlock()
			}
		})
	}
	workers.Wait()
	c.event("reconciliation: %d payments told are gone (GET 404); sent again with their key and first-sent time: %d came back as told, %d other",
		rs.gone, rs.restored, rs.other)
	slices.Sort(problems)
	for _, p := range problems[:min(len(problems), maxProblems)] {
		c.event("  %s", p)
	}
	return rs
}

// resend asks the API for o's payment and, when it answers 404, sends o
// again with its key and first-sent time. It reports whether the payment
// was gone, whether it came back as o's client was told, and otherwise
// what went wrong.
func resend(ctx context.Context, client *idem.Client, o *op) (gone, restored bool, problem string) {
	_, err := client.Get(ctx, "/v1/payments/"+o.paymentID, nil)
	var apiErr *idem.APIError
	switch {
	case err == nil:
		return false, false, fmt.Sprintf("op %d (client %s, key %s): payment %s is missing from the database, yet GET finds it", o.n, o.account.id, o.key, o.paymentID)
	case !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusNotFound:
		return false, false, fmt.Sprintf("op %d (client %s, key %s): GET its payment: %v", o.n, o.account.id, o.key, err)
	}
	var out struct {
		ID     string `json:"id"`
		Charge string `json:"charge"`
	}
	body := map[string]any{"amount": o.amount, "currency": "usd", "customer": o.customer}
	resp, err := client.Post(idem.WithFirstSent(idem.WithKey(ctx, o.key), o.firstSent), "/v1/payments", body, &out)
	switch {
	case err != nil:
		return true, false, fmt.Sprintf("op %d (client %s, key %s): sent again: %v", o.n, o.account.id, o.key, err)
	case resp.StatusCode != http.StatusCreated || out.ID != o.paymentID || out.Charge != o.chargeID:
		return true, false, fmt.Sprintf("op %d (client %s, key %s): told payment %s charge %s; sent again: %d, payment %s charge %s",
			o.n, o.account.id, o.key, o.paymentID, o.chargeID, resp.StatusCode, out.ID, out.Charge)
	}
	return true, true, ""
}
