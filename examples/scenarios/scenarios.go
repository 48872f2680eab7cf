package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/server"
	"github.com/idemkit/idem/server/idempotency"
)

// scenarios are the stories of the article, in the order they are told.
var scenarios = []scenario{
	{
		name:  "lost-response",
		title: "the response is lost after the server committed",
		run:   lostResponse,
		want:  expected{1, 1, ""},
	},
	{
		name:  "server-errors",
		title: "503, 503, then success",
		run:   serverErrors,
		want:  expected{1, 1, ""},
	},
	{
		name:   "slow-server",
		title:  "an attempt times out while the server is still working",
		server: func(c *server.Config) { c.ProcessorDelay = 400 * time.Millisecond },
		run:    slowServer,
		want:   expected{1, 1, ""},
	},
	{
		name:  "concurrent",
		title: "two concurrent requests with one key",
		run:   concurrent,
		want:  expected{1, 1, ""},
	},
	{
		name:  "key-reuse",
		title: "a key reused with another body",
		run:   keyReuse,
		want:  expected{1, 1, ""},
	},
	{
		name:  "invalid-text",
		title: "a NUL and invalid UTF-8 in a field: 400 before any charge; the corrected request with the same key pays",
		run:   invalidText,
		want:  expected{1, 1, ""},
	},
	{
		name:  "changed-body",
		title: "the card is charged, the server answers 502; the app gives up, re-prices the order under the same key, then resends the original",
		run:   changedBody,
		want:  expected{1, 1, ""},
	},
	{
		name:  "missing-key",
		title: "a request without a key against the raw API",
		run:   missingKey,
		want:  expected{0, 0, "refused before anything was done"},
	},
	{
		name:   "crash",
		title:  "the server crashes mid-request; the stuck key is taken over after the lock timeout",
		server: func(c *server.Config) { c.LockTimeout = crashLockTimeout },
		run:    crash,
		want:   expected{1, 1, ""},
	},
	{
		name:   "deploy",
		title:  "a deploy: instance A drains and stops mid-call (HTTP/2 GOAWAY); the retry reaches instance B on the same storage",
		server: func(c *server.Config) { c.ProcessorDelay = deployProcessorDelay },
		run:    deploy,
		want:   expected{1, 1, ""},
	},
	{
		name:  "slow-alive",
		title: "a request alive past the lock timeout keeps its key (its lease is renewed): the duplicate waits",
		server: func(c *server.Config) {
			c.LockTimeout = aliveLockTimeout
			c.ProcessorDelay = aliveProcessorDelay
		},
		run:  slowAlive,
		want: expected{1, 1, ""},
	},
	{
		name:   "retention",
		title:  "the key expires after retention; its operation asked again charges once, a new first-sent time starts a new one",
		server: func(c *server.Config) { c.Retention = retention },
		run:    expiry,
		want:   expected{2, 2, "the same operation after retention is its payment; a new first-sent time is a new payment"},
	},
	{
		name:  "retention-resume",
		title: "a failed request resumed after the retention counted from its key's creation: still one charge; a retry after the retention is refused, not run",
		server: func(c *server.Config) {
			c.Retention = resumeRetention
			c.ProcessorDelay = resumeProcessorDelay
			c.ProcessorRetry = idem.RetryPolicy{MaxAttempts: 3, InitialInterval: 20 * time.Millisecond, MaxInterval: 50 * time.Millisecond}
		},
		run:  retentionResume,
		want: expected{1, 1, ""},
	},
	{
		name:  "key-per-attempt",
		title: "the classic client bug, a new key per attempt, against one key per operation",
		run:   keyPerAttempt,
		want:  expected{3, 3, "2 by the naive loop (the bug shown), 1 by idem"},
	},
}

// customer is the customer id of a scenario's payments.
func customer(name string) string { return "cus_" + identifier(name) }

// lostResponse: the server commits the payment, the answer never reaches
// the client, the client retries with the same key and gets the stored
// answer.
func lostResponse(ctx context.Context, e *env) error {
	e.faults.add(loseResponse)
	c := e.client(e.transport(policy))
	cus := customer("lost-response")
	_, resp, err := e.pay(ctx, c, "pay", payment{Amount: 4200, Currency: "usd", Customer: cus})
	if err != nil {
		return err
	}
	e.expect(e.faults.count() == 1, "first response lost")
	e.expect(idem.Replayed(resp), "the retry got the stored response (Idempotent-Replayed)")
	return e.expectStored(ctx, cus, 1, 1)
}

// serverErrors: a proxy answers 503 twice; the third attempt reaches the
// server.
func serverErrors(ctx context.Context, e *env) error {
	e.faults.add(unavailable, unavailable)
	c := e.client(e.transport(policy))
	cus := customer("server-errors")
	_, resp, err := e.pay(ctx, c, "pay", payment{Amount: 4200, Currency: "usd", Customer: cus})
	if err != nil {
		return err
	}
	attempts, keys := e.tl.count(func(event) bool { return true }), e.tl.keys()
	e.expect(attempts == 3 && keys == 1, "%d attempts, %d key", attempts, keys)
	e.expect(resp.StatusCode == http.StatusCreated && !idem.Replayed(resp), "the last one created the payment")
	return e.expectStored(ctx, cus, 1, 1)
}

// slowServer: the card processor takes 400ms, the client gives each
// attempt 150ms. The first attempt times out while the server works on; the
// retry finds the key in progress (409), waits, and gets the outcome.
func slowServer(ctx context.Context, e *env) error {
	p := policy
	p.AttemptTimeout = 150 * time.Millisecond
	c := e.client(e.transport(p))
	cus := customer("slow-server")
	_, resp, err := e.pay(ctx, c, "pay", payment{Amount: 4200, Currency: "usd", Customer: cus})
	if err != nil {
		return err
	}
	timedOut := e.tl.count(func(ev event) bool { return ev.outcome == "attempt timed out" })
	e.expect(timedOut >= 1, "attempts timed out: %d", timedOut)
	e.expect(resp.StatusCode == http.StatusCreated, "ended in %s", statusLine(resp.StatusCode))
	return e.expectStored(ctx, cus, 1, 1)
}

// concurrent: two requests with one key at once, as two workers retrying
// the same job would send. One runs; the other gets 409, waits, and gets
// the first one's answer.
func concurrent(ctx context.Context, e *env) error {
	// Hold the running request after its charge until the other one has
	// been answered 409, so the story does not depend on timing.
	answered := make(chan struct{})
	var once sync.Once
	e.onAttempt(func(a idem.Attempt) {
		if a.Response != nil && a.Response.StatusCode == http.StatusConflict {
			once.Do(func() { close(answered) })
		}
	})
	e.onCharge(func(ctx context.Context) error {
		e.tl.note("the request that claimed the key is charged; it is held until the other is answered")
		t := time.NewTimer(10 * time.Second)
		defer t.Stop()
		select {
		case <-answered:
		case <-t.C:
		case <-ctx.Done():
		}
		return nil
	})
	c := e.client(e.transport(policy))
	cus := customer("concurrent")
	in := payment{Amount: 4200, Currency: "usd", Customer: cus}
	ctx = idem.WithKey(ctx, idem.NewKey())
	a, b := e.payAsync(ctx, c, "A", in), e.payAsync(ctx, c, "B", in)
	answers := [2]answer{<-a, <-b}
	replays := 0
	for _, a := range answers {
		if a.err != nil {
			return a.err
		}
		if idem.Replayed(a.resp) {
			replays++
		}
	}
	conflicts := e.tl.count(func(ev event) bool { return strings.HasPrefix(ev.outcome, "409") })
	e.expect(conflicts >= 1, "409 x%d while the other ran", conflicts)
	e.expect(replays == 1, "one ran, the other got its replay (replays: %d)", replays)
	e.expect(answers[0].p.ID == answers[1].p.ID, "both got %s", answers[0].p.ID)
	return e.expectStored(ctx, cus, 1, 1)
}

// keyReuse: a key is sent again with another amount: the server answers
// 422, and idem returns a *idem.KeyReuseError instead of retrying.
func keyReuse(ctx context.Context, e *env) error {
	c := e.client(e.transport(policy))
	cus := customer("key-reuse")
	key := idem.NewKey()
	ctx = idem.WithKey(ctx, key)
	if _, _, err := e.pay(ctx, c, "first", payment{Amount: 4200, Currency: "usd", Customer: cus}); err != nil {
		return err
	}
	if !expectKeyReuse(ctx, e, c, "reuse", key, payment{Amount: 9900, Currency: "usd", Customer: cus}) {
		return nil
	}
	return e.expectStored(ctx, cus, 1, 1)
}

// expectKeyReuse pays in under key, labelled op, and checks that the
// server refused it as a key reused with another request, in one attempt
// (a 422 is not retried). It shows the error as the developer sees it.
func expectKeyReuse(ctx context.Context, e *env, c *idem.Client, op, key string, in payment) bool {
	_, _, err := e.pay(ctx, c, op, in)
	var reuse *idem.KeyReuseError
	if !errors.As(err, &reuse) {
		e.expect(false, "the %s Post returned a *idem.KeyReuseError (got %v)", op, err)
		return false
	}
	e.note(fmt.Sprintf("what the developer sees (err.Error() of the %s Post):", op))
	e.note(wrap(err.Error(), 96)...)
	sent := e.tl.count(func(ev event) bool { return ev.op == op })
	e.expect(reuse.Key == key && reuse.Problem.Status == http.StatusUnprocessableEntity && sent == 1,
		"*idem.KeyReuseError with the key and the server's 422, after %d attempt", sent)
	return true
}

// changedBody: the card processor charges but its answers never reach the
// server, which answers 502 and releases the key with its operation. The
// app gives up, then sends the payment again under the same key with
// another amount (a re-priced order, a timestamp in the body: the
// article's "422 errors after a client release"). A new operation would
// leave the first charge without a payment, or charge twice; the server
// refuses it with 422. The original request, resent once the processor
// answers again, finds the first charge: one payment, one charge.
func changedBody(ctx context.Context, e *env) error {
	proc := e.srv.Processor()
	proc.LoseNext(1 << 20) // every answer: the server's own retries too
	e.tl.fault("the card processor charges, but none of its answers reach the server")
	p := policy
	p.MaxAttempts = 2 // the app's policy for this call: see the note on the timeline
	c := e.client(e.transport(p))
	cus := customer("changed-body")
	key := idem.NewKey()
	ctx = idem.WithKey(ctx, key)
	first := payment{Amount: 4200, Currency: "usd", Customer: cus}
	_, _, err := e.pay(ctx, c, "pay", first)
	if apiErr := (*idem.APIError)(nil); errors.As(err, &apiErr) && apiErr.StatusCode == http.StatusBadGateway {
		e.expect(true, "the payment failed with the server's 502")
	} else {
		e.expect(false, "the payment failed with the server's 502 (got %v)", err)
	}
	charged, err := e.charges(ctx)
	if err != nil {
		return err
	}
	e.expect(charged == 1, "the card was charged once nonetheless: %d charge", charged)

	proc.LoseNext(0)
	e.tl.note("the app shows the error; the order is re-priced to 4300 and sent again with the same key")
	if !expectKeyReuse(ctx, e, c, "re-priced", key, payment{Amount: 4300, Currency: "usd", Customer: cus}) {
		return nil
	}

	e.tl.note("the processor answers again; the app resends the original request (4200) with the same key")
	out, resp, err := e.pay(ctx, c, "resend", first)
	if err != nil {
		return err
	}
	e.expect(resp.StatusCode == http.StatusCreated && out.Amount == first.Amount,
		"the original request, resent, created the payment of %d (%s)", out.Amount, statusLine(resp.StatusCode))
	return e.expectStored(ctx, cus, 1, 1)
}

// missingKey: a client that does not use idem forgets the key. The server
// refuses the payment with 400 and problem details that say what to do.
func missingKey(ctx context.Context, e *env) error {
	cus := customer("missing-key")
	body, _ := json.Marshal(payment{Amount: 4200, Currency: "usd", Customer: cus})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.url+"/v1/payments", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Content-Type", "application/json")
	resp, err := (&http.Client{Transport: e.base}).Do(req)
	e.tl.rawAttempt("raw", 1, "", resp, err, "done")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if err != nil {
		return err
	}
	ct := resp.Header.Get("Content-Type")
	e.note(fmt.Sprintf("what the developer sees: %s, Content-Type: %s", statusLine(resp.StatusCode), ct))
	var pretty bytes.Buffer
	if json.Indent(&pretty, raw, "", "  ") == nil {
		e.note(strings.Split(strings.TrimSpace(pretty.String()), "\n")...)
	} else {
		e.note(strings.TrimSpace(string(raw)))
	}
	var problem idem.Problem
	mt, _, _ := mime.ParseMediaType(ct)
	e.expect(resp.StatusCode == http.StatusBadRequest, "status %d", resp.StatusCode)
	e.expect(mt == "application/problem+json" && json.Unmarshal(raw, &problem) == nil && problem.Type == idempotency.ProblemKeyMissing,
		"problem+json of type idempotency-key-missing")
	return e.expectStored(ctx, cus, 0, 0)
}

// crashLockTimeout is the lock timeout of the crash scenario's server: a
// started key older than this is presumed dead and may be taken over.
const crashLockTimeout = 500 * time.Millisecond

// crash: the server charges the card, then dies before it records the
// payment. The key stays started: retries get 409 until the lock timeout,
// then one takes the key over, finds the charge already made (the
// processor call is keyed by the operation) and records the payment.
func crash(ctx context.Context, e *env) error {
	var crashed atomic.Bool
	e.onCharge(func(context.Context) error {
		if crashed.CompareAndSwap(false, true) {
			e.tl.fault("the server crashes after the charge, before recording the payment; the key stays started")
			return errors.New("injected crash")
		}
		return nil
	})
	c := e.client(e.transport(policy))
	cus := customer("crash")
	_, resp, err := e.pay(ctx, c, "pay", payment{Amount: 4200, Currency: "usd", Customer: cus})
	if err != nil {
		return err
	}
	stuck := e.tl.count(func(ev event) bool { return strings.HasPrefix(ev.outcome, "409") })
	tookOver, err := e.counter("idem_keys_taken_over_total")
	if err != nil {
		return err
	}
	e.expect(stuck >= 1, "key stuck: 409 x%d", stuck)
	e.expect(tookOver == 1, "taken over after the %s lock timeout (takeovers: %v)", crashLockTimeout, tookOver)
	e.expect(resp.StatusCode == http.StatusCreated, "ended in %s", statusLine(resp.StatusCode))
	return e.expectStored(ctx, cus, 1, 1)
}

// retention is how long the retention scenario's server keeps a key.
const retention = time.Second

// expiry: within retention a retry gets the replay; once the key has
// expired, the same operation (the same key and first-sent time) asked
// again derives the same operation ID, and gets its payment, charged
// once; the same key with a new first-sent time is a new operation (as
// Stripe documents for keys older than 24 hours).
func expiry(ctx context.Context, e *env) error {
	c := e.client(e.transport(policy))
	cus := customer("retention")
	in := payment{Amount: 4200, Currency: "usd", Customer: cus}
	ctx = idem.WithKey(ctx, idem.NewKey())
	op := idem.WithFirstSent(ctx, time.Now())
	first, _, err := e.pay(op, c, "first", in)
	if err != nil {
		return err
	}
	again, resp, err := e.pay(op, c, "retry", in)
	if err != nil {
		return err
	}
	e.expect(idem.Replayed(resp) && again.ID == first.ID, "within retention: replay of %s", first.ID)
	wait := retention + 300*time.Millisecond
	e.tl.note("the client waits %s; the server keeps keys for %s", wait, retention)
	if err := sleep(ctx, wait); err != nil {
		return err
	}
	later, _, err := e.pay(op, c, "later", in)
	if err != nil {
		return err
	}
	e.expect(later.ID == first.ID, "after retention, the same operation: its payment %s", first.ID)
	e.tl.note("the client waits %s again: the answer to its ask is kept for that long", wait)
	if err := sleep(ctx, wait); err != nil {
		return err
	}
	fresh, resp, err := e.pay(idem.WithFirstSent(ctx, time.Now().Add(time.Second)), c, "new", in)
	if err != nil {
		return err
	}
	e.expect(!idem.Replayed(resp) && fresh.ID != first.ID, "after retention, a new first-sent time: new payment %s", fresh.ID)
	return e.expectStored(ctx, cus, 2, 2)
}

// invalidText: a client sends a NUL in the customer (JSON), then invalid
// UTF-8 in a form field, under one key. Text a database cannot store, or
// that another system would read otherwise, must be refused with 400
// before the card is charged: after a charge, the failure would hold the
// key for that request alone and the corrected one would get 422. A 400
// releases the key with nothing done, so the corrected request with the
// same key is a new operation and pays once.
func invalidText(ctx context.Context, e *env) error {
	tr := e.transport(policy)
	c := e.client(tr)
	cus := customer("invalid-text")
	ctx = idem.WithKey(ctx, idem.NewKey())

	_, _, err := e.pay(ctx, c, "nul", payment{Amount: 4200, Currency: "usd", Customer: cus + "\x00"})
	expectInvalid(e, "a NUL in customer (JSON)", err)

	form := "amount=4200&currency=usd&customer=" + cus + "%FF" // %FF: not UTF-8
	req, err := http.NewRequestWithContext(withOp(ctx, "form"), http.MethodPost, e.url+"/v1/payments", strings.NewReader(form))
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	if resp, err := (&http.Client{Transport: tr}).Do(req); err == nil {
		raw, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		resp.Body.Close()
		if resp.StatusCode >= 300 {
			err = &idem.APIError{StatusCode: resp.StatusCode, Body: raw}
		}
		expectInvalid(e, "invalid UTF-8 in customer (form)", err)
	} else {
		expectInvalid(e, "invalid UTF-8 in customer (form)", err)
	}

	charged, err := e.charges(ctx)
	if err != nil {
		return err
	}
	e.expect(charged == 0, "no charge for either: %d", charged)

	e.tl.note("the app fixes the customer and sends the payment again with the same key")
	out, resp, err := e.pay(ctx, c, "fixed", payment{Amount: 4200, Currency: "usd", Customer: cus})
	if err != nil {
		e.expect(false, "the corrected request succeeded (got %v)", err)
		return e.expectStored(ctx, cus, 1, 1)
	}
	e.expect(resp.StatusCode == http.StatusCreated && out.Customer == cus,
		"the corrected request created the payment (%s)", statusLine(resp.StatusCode))
	return e.expectStored(ctx, cus, 1, 1)
}

// expectInvalid checks that err is the server's 400 for what, and shows
// the field errors the developer reads.
func expectInvalid(e *env, what string, err error) {
	if err == nil {
		e.expect(false, "%s refused with 400 (it was accepted)", what)
		return
	}
	var apiErr *idem.APIError
	if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusBadRequest {
		e.expect(false, "%s refused with 400 (got %v)", what, err)
		return
	}
	var problem struct {
		Errors []struct{ Field, Detail string } `json:"errors"`
	}
	_ = json.Unmarshal(apiErr.Body, &problem)
	for _, fe := range problem.Errors {
		e.note(fmt.Sprintf("%s: %s %s", what, fe.Field, fe.Detail))
	}
	e.expect(true, "%s refused with 400", what)
}

// aliveLockTimeout is the lock timeout of the slow-alive scenario's
// server, and aliveProcessorDelay its card processor's latency, five
// times longer.
const (
	aliveLockTimeout    = 300 * time.Millisecond
	aliveProcessorDelay = 5 * aliveLockTimeout
)

// slowAlive: the card processor takes five lock timeouts. The request is
// slow but alive: its lease is renewed while it runs, so a duplicate sent
// after two lock timeouts gets 409, not the key: no takeover, the
// duplicate waits and gets the replay, one payment.
func slowAlive(ctx context.Context, e *env) error {
	c := e.client(e.transport(policy))
	cus := customer("slow-alive")
	in := payment{Amount: 4200, Currency: "usd", Customer: cus}
	ctx = idem.WithKey(ctx, idem.NewKey())
	first := e.payAsync(ctx, c, "A", in)
	for {
		claimed, err := e.counter("idem_keys_claimed_total")
		if err != nil {
			return err
		}
		if claimed >= 1 {
			break
		}
		if err := sleep(ctx, 5*time.Millisecond); err != nil {
			return err
		}
	}
	e.tl.note("A holds the key; its card processor takes %s, the lock timeout is %s", aliveProcessorDelay, aliveLockTimeout)
	if err := sleep(ctx, 2*aliveLockTimeout); err != nil {
		return err
	}
	e.tl.note("%s later, a duplicate B is sent with the same key", 2*aliveLockTimeout)
	pb, respB, errB := e.pay(ctx, c, "B", in)
	a := <-first
	if a.err != nil {
		return a.err
	}
	if errB != nil {
		return errB
	}
	conflicts := e.tl.count(func(ev event) bool { return ev.op == "B" && strings.HasPrefix(ev.outcome, "409") })
	tookOver, err := e.counter("idem_keys_taken_over_total")
	if err != nil {
		return err
	}
	renewed, err := e.counter("idem_leases_renewed_total")
	if err != nil {
		return err
	}
	e.expect(conflicts >= 1, "B waited: 409 x%d", conflicts)
	e.expect(tookOver == 0, "the key was not taken over (takeovers: %v)", tookOver)
	e.expect(renewed >= 1, "A's lease was renewed (renewals: %v)", renewed)
	e.expect(a.p.ID == pb.ID && !idem.Replayed(a.resp) && idem.Replayed(respB),
		"A created %s, B got its replay", a.p.ID)
	return e.expectStored(ctx, cus, 1, 1)
}

// The retention and the card processor's latency in the retention-resume
// scenario: with the server's three tries at the processor, the first
// request outlives the retention. The retention is long enough for the
// first-sent policy, whose header has a precision of one second
// (idempotency.MinFirstSentRetention).
const (
	resumeRetention      = 3 * time.Second
	resumeProcessorDelay = 1050 * time.Millisecond
)

// retentionResume: the card processor charges but its answers are lost;
// the server tries it three times, longer than the retention, then answers
// 502 and releases the key, which keeps its operation. The client's retry
// comes after more than the retention since the key was created, but less
// since it was released: retention counts from the end of the request, so
// the retry resumes the operation and finds the charge. Counted from the
// creation, the key would have expired, and the retry, a new operation,
// would charge the card again.
func retentionResume(ctx context.Context, e *env) error {
	proc := e.srv.Processor()
	proc.LoseNext(1 << 20)
	e.tl.fault("the card processor charges, but its answers are lost; the server tries it 3 times, %s each", resumeProcessorDelay)
	var released, resumed time.Time
	e.onAttempt(func(a idem.Attempt) {
		if a.Number == 1 && a.Response != nil && a.Response.StatusCode == http.StatusBadGateway {
			proc.LoseNext(0)
			released = time.Now()
			resumed = released.Add(a.Wait)
			e.tl.note("the server released the key: it is kept %s from now, with its operation", resumeRetention)
		}
	})
	c := e.client(e.transport(policy))
	cus := customer("retention-resume")
	start := time.Now()
	// The key and its first-sent time, stored with the order before the
	// first call, as an application that retries from a queue does.
	ctx = idem.WithFirstSent(idem.WithKey(ctx, idem.NewKey()), start)
	in := payment{Amount: 4200, Currency: "usd", Customer: cus}
	out, resp, err := e.pay(ctx, c, "pay", in)
	if err != nil {
		return err
	}
	e.expect(!released.IsZero() && resumed.Sub(start) > resumeRetention && resumed.Sub(released) < resumeRetention,
		"the retry came %s after the key was created, %s after it was released (retention %s)",
		resumed.Sub(start).Round(time.Millisecond), resumed.Sub(released).Round(time.Millisecond), resumeRetention)
	e.expect(resp.StatusCode == http.StatusCreated && out.ID != "", "it resumed the operation: %s", statusLine(resp.StatusCode))

	// A queued retry of the same operation, after the key's retention:
	// the server no longer has the key, and the request says it was first
	// sent long before, so it is refused instead of paid again.
	wait := resumeRetention + 300*time.Millisecond
	e.tl.note("a queued retry of the operation waits %s past its success; the server keeps keys for %s", wait, resumeRetention)
	if err := sleep(ctx, wait); err != nil {
		return err
	}
	_, _, err = e.pay(ctx, c, "late retry", in)
	var expired *idem.KeyExpiredError
	if errors.As(err, &expired) && idem.OutcomeOf(nil, err) == idem.OutcomeUnknown {
		e.expect(true, "the late retry is refused, not run: *idem.KeyExpiredError, outcome unknown")
	} else {
		e.expect(false, "the late retry: %v, want *idem.KeyExpiredError", err)
	}
	return e.expectStored(ctx, cus, 1, 1)
}

// keyPerAttempt: the same lost response, met by two clients. A naive
// retry loop that makes a new key on every attempt creates a second
// payment and a second charge; idem, one key per operation, does not.
func keyPerAttempt(ctx context.Context, e *env) error {
	e.faults.add(loseResponse, pass, loseResponse)

	naiveCus := customer("key-per-attempt-naive")
	if err := naiveLoop(ctx, e, payment{Amount: 4200, Currency: "usd", Customer: naiveCus}); err != nil {
		return err
	}
	naivePayments, err := e.payments(ctx, naiveCus)
	if err != nil {
		return err
	}
	naiveCharges, err := e.charges(ctx)
	if err != nil {
		return err
	}

	idemCus := customer("key-per-attempt-idem")
	c := e.client(e.transport(policy))
	_, resp, err := e.pay(ctx, c, "idem", payment{Amount: 4200, Currency: "usd", Customer: idemCus})
	if err != nil {
		return err
	}
	idemPayments, err := e.payments(ctx, idemCus)
	if err != nil {
		return err
	}
	charges, err := e.charges(ctx)
	if err != nil {
		return err
	}
	idemCharges := charges - naiveCharges

	e.expect(naivePayments == 2 && naiveCharges == 2,
		"new key per attempt: %d payments, %d charges for one purchase (the bug shown)", naivePayments, naiveCharges)
	e.expect(idemPayments == 1 && idemCharges == 1 && idem.Replayed(resp),
		"one key per operation: %d payment, %d charge, retry replayed", idemPayments, idemCharges)
	return nil
}

// naiveLoop is the client bug of the article's troubleshooting section:
// it retries a lost response, but makes a new key for every attempt, so
// the server cannot tell the retry from a new payment.
func naiveLoop(ctx context.Context, e *env, in payment) error {
	body, _ := json.Marshal(in)
	hc := &http.Client{Transport: e.base}
	for n := 1; n <= 3; n++ {
		key := idem.NewKey() // the bug: this belongs outside the loop
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.url+"/v1/payments", bytes.NewReader(body))
		if err != nil {
			return err
		}
		req.Header.Set("Authorization", "Bearer "+token)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		resp, err := hc.Do(req)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			e.tl.rawAttempt("naive", n, key, nil, err, "retry in 50ms, with a new key")
			if err := sleep(ctx, 50*time.Millisecond); err != nil {
				return err
			}
			continue
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		e.tl.rawAttempt("naive", n, key, resp, nil, "done")
		if resp.StatusCode < 500 {
			return nil
		}
	}
	return errors.New("the naive loop gave up")
}

// sleep waits d or until ctx is done.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// wrap breaks s into lines of at most width characters, at spaces.
func wrap(s string, width int) []string {
	var lines []string
	var line strings.Builder
	for _, word := range strings.Fields(s) {
		if line.Len() > 0 && line.Len()+1+len(word) > width {
			lines = append(lines, line.String())
			line.Reset()
		}
		if line.Len() > 0 {
			line.WriteByte(' ')
		}
		line.WriteString(word)
	}
	if line.Len() > 0 {
		lines = append(lines, line.String())
	}
	return lines
}
