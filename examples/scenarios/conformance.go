package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"mime"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/idemkit/idem"
)

// The conformance check (-target) sends a few POST (or PATCH) requests to
// an endpoint nobody here wrote and says, row by row, whether what a
// client can observe follows the Idempotency-Key contract: the IETF draft,
// and Stripe's behaviour where the draft is silent. It is a tool for API
// providers (check the endpoint before clients rely on it) and for clients
// choosing a provider (check what retrying with a key really does).
//
// It sends only the requests its plan lists (-dry-run prints the plan and
// sends nothing), each once, on a connection of its own, never retried,
// and it stops before a request could make more operations than
// -max-operations (-max-payments): every request holds an operation slot
// until its answer shows that it made none (a 4xx, or a replay of an
// earlier answer).
//
// A row conforms only when its premise held: a row that compares answers
// needs answers that tell one operation from another, a row about keys
// needs a key the server is seen to keep (the replay row), a 4xx counts
// only if the same request is accepted without what the row changes. A
// row whose premise failed is not checkable and says why, and so is every
// row whose requests were refused with 401 or 403 (credentials refused).
//
// It speaks of payments when the body is the default one, a payment in the
// reference server's shape, and of operations otherwise.

// conformanceConfig is what the -target flags ask for.
type conformanceConfig struct {
	target string
	method string // POST or PATCH
	// creds are the headers each client sends with every request: its
	// credentials (-token, -header; -token2, -header2). creds[1] empty:
	// the per-client row is not checkable.
	creds     [2]http.Header
	body      []byte
	slowBody  []byte // nil: the in-flight row is not checkable
	maxOps    int
	retention time.Duration // the retention the provider publishes; 0: unknown
	wait      bool          // wait the retention out
	dryRun    bool
	timeout   time.Duration // per request
}

// noun is what a request of the check makes: "payment" with the default
// body, else "operation".
func (cfg *conformanceConfig) noun() string {
	if string(cfg.body) == defaultConformanceBody {
		return "payment"
	}
	return "operation"
}

// maxFlag is -max-operations's name in the report, after the noun.
func (cfg *conformanceConfig) maxFlag() string { return "-max-" + cfg.noun() + "s" }

// defaultConformanceBody is the body of -body's default: a payment in the
// shape of the reference server's API.
const defaultConformanceBody = `{"amount": 4200, "currency": "usd", "customer": "cus_idem_conformance"}`

// inFlightAfter is how long the duplicate of the in-flight row waits
// after the first request was sent: long enough for it to have reached the
// server and claimed its key, far shorter than a slow request.
const inFlightAfter = 200 * time.Millisecond

// The three verdicts of a row.
const (
	conforms     = "conforms"
	differs      = "differs"
	notCheckable = "not checkable"
)

// What the check sends and reads: the key header, Stripe's replay marker,
// RFC 9457's media type.
const (
	keyHeaderName = idem.DefaultKeyHeader
	replayHeader  = "Idempotent-Replayed"
	problemJSON   = "application/problem+json"
	// ttlHeader is how long the API keeps a key, in seconds, as the IETF
	// draft's issue #49 proposes; firstSentHeader, when a request's
	// operation was first sent (OASIS Repeatable Requests).
	ttlHeader       = "Idempotency-TTL"
	firstSentHeader = "Repeatability-First-Sent"
)

// finding is the verdict of one row: conforms, differs or not checkable,
// with what the server did or why it could not be checked.
type finding struct {
	kind string
	why  string
}

func (v finding) String() string {
	if v.why == "" {
		return v.kind
	}
	return v.kind + " (" + v.why + ")"
}

// probe is one request of the plan.
type probe struct {
	label  string // what it is, for the plan and the report
	client int    // 1 or 2: whose credentials
	key    string // "": no key header
	sf     bool   // send the key as an RFC 9651 sf-string: "key"
	body   []byte
	when   string // for the plan: when it is sent, if not at once
	// firstSent, if not zero, is sent as Repeatability-First-Sent: when
	// the request's operation was first sent.
	firstSent time.Time
}

// reply is what a probe got.
type reply struct {
	probe   *probe
	seq     int // its place in the order the requests were sent
	status  int
	header  http.Header
	body    []byte
	err     error
	elapsed time.Duration
	sentAt  time.Time
}

// ok2xx reports whether the reply is a success.
func (r *reply) ok2xx() bool { return r.err == nil && r.status >= 200 && r.status < 300 }

// refused reports whether the reply refused the request's credentials.
func (r *reply) refused() bool {
	return r.err == nil && (r.status == http.StatusUnauthorized || r.status == http.StatusForbidden)
}

// replayMarked reports whether r carries Stripe's replay marker and o, the
// first answer, does not: the marker tells a replay from a second run.
func (r *reply) replayMarked(o *reply) bool {
	return strings.EqualFold(r.header.Get(replayHeader), "true") && !strings.EqualFold(o.header.Get(replayHeader), "true")
}

// same reports whether r repeats o: the same status and the same body,
// compared as JSON when both are JSON (a server may re-encode a stored
// answer), else byte for byte.
func (r *reply) same(o *reply) bool {
	if r.err != nil || o.err != nil || r.status != o.status {
		return false
	}
	var a, b any
	if json.Unmarshal(r.body, &a) == nil && json.Unmarshal(o.body, &b) == nil {
		ja, _ := json.Marshal(a)
		jb, _ := json.Marshal(b)
		return bytes.Equal(ja, jb)
	}
	return bytes.Equal(r.body, o.body)
}

// String is the reply as the report shows it.
func (r *reply) String() string {
	if r.err != nil {
		return "no answer: " + r.err.Error()
	}
	s := statusLine(r.status)
	if ct := r.header.Get("Content-Type"); ct != "" {
		mt, _, _ := mime.ParseMediaType(ct)
		s += ", " + cmp.Or(mt, ct)
	}
	if v := r.header.Get(replayHeader); v != "" {
		s += ", " + replayHeader + ": " + v
	}
	if v := r.header.Get("Retry-After"); v != "" {
		s += ", Retry-After: " + v
	}
	return s
}

// row is one line of the contract, the probes it may send and how it
// judges their replies.
type row struct {
	name   string
	rule   string // what the contract says
	probes []*probe
	skip   string // not empty: not checkable, for this reason, and nothing is sent
	judge  func(ctx context.Context, c *checker) finding
}

// checker sends the probes and keeps what they got.
type checker struct {
	cfg     conformanceConfig
	hc      *http.Client
	out     io.Writer
	replies map[*probe]*reply

	mu       sync.Mutex
	inFlight int // requests sent and not yet answered
	sent     int
	answered int    // replies with a status
	refusals int    // of which refused the credentials (401, 403)
	refusal  string // the first refusal, as the report says it
}

// Errors of send for a request it did not send.
var (
	// errBudget: the request could make more operations than
	// -max-operations allows.
	errBudget = errors.New("budget")
	// errRefused: every request so far was refused (401, 403): the
	// credentials are wrong, and nothing more is sent.
	errRefused = errors.New("credentials refused")
)

// send sends p once and returns its reply, or errBudget or errRefused
// without sending.
func (c *checker) send(ctx context.Context, p *probe) (*reply, error) {
	c.mu.Lock()
	if c.refusedAllLocked() {
		c.mu.Unlock()
		return nil, errRefused
	}
	if c.inFlight+c.made() >= c.cfg.maxOps {
		c.mu.Unlock()
		return nil, errBudget
	}
	c.inFlight++
	c.sent++
	r := &reply{probe: p, seq: c.sent, sentAt: time.Now()}
	c.mu.Unlock()

	resp, err := c.do(ctx, p)
	r.elapsed = time.Since(r.sentAt)
	if err != nil {
		r.err = err
	} else {
		r.status, r.header = resp.StatusCode, resp.Header
		r.body, r.err = io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		resp.Body.Close()
	}

	c.mu.Lock()
	c.inFlight--
	if r.err == nil {
		c.answered++
		if r.refused() {
			c.refusals++
			if c.refusal == "" {
				c.refusal = refusedBy(p, r)
			}
		}
	}
	c.replies[p] = r
	fmt.Fprintf(c.out, "    %-44s -> %s  %s\n", p.label, r, r.elapsed.Round(time.Millisecond))
	c.mu.Unlock()
	return r, nil
}

// refusedAll reports whether every request so far was refused (401, 403),
// and the first refusal as the report says it.
func (c *checker) refusedAll() (string, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.refusal, c.refusedAllLocked()
}

func (c *checker) refusedAllLocked() bool { return c.answered > 0 && c.refusals == c.answered }

// made returns the number of requests answered that may have made an
// operation; c.mu is held. It is computed again from every reply each
// time, as a later answer may show that an earlier repeat proved nothing.
func (c *checker) made() int {
	n := 0
	for _, r := range c.replies {
		if c.mayHaveMade(r) {
			n++
		}
	}
	return n
}

// mayHaveMade reports whether r may have made an operation: anything may
// but a 4xx and a replay; c.mu is held.
func (c *checker) mayHaveMade(r *reply) bool {
	switch {
	case r.err != nil:
		return true
	case r.status >= 400 && r.status < 500:
		return false
	case !r.ok2xx():
		return true
	}
	return !c.replayed(r)
}

// replayed reports whether r, a success, shows that it made nothing: it
// repeats the answer to an earlier request with the same key from the
// same client, and carries the replay marker that answer lacks, or no
// request with another key (or none) got the same answer, so that answers
// tell operations apart; c.mu is held. The same key from another client
// proves nothing either way: keys may be shared by clients.
func (c *checker) replayed(r *reply) bool {
	repeat, marked, shared := false, false, false
	for _, o := range c.replies {
		switch {
		case o == r || !o.ok2xx() || !r.same(o):
		case o.probe.key == "" || o.probe.key != r.probe.key:
			shared = true // another operation got this answer
		case o.probe.client == r.probe.client && o.seq < r.seq:
			repeat = true
			marked = marked || r.replayMarked(o)
		}
	}
	return marked || repeat && !shared
}

// madeNow returns the number of requests answered that may have made an
// operation.
func (c *checker) madeNow() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.made()
}

func (c *checker) do(ctx context.Context, p *probe) (*http.Response, error) {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.timeout)
	req, err := http.NewRequestWithContext(ctx, c.cfg.method, c.cfg.target, bytes.NewReader(p.body))
	if err != nil {
		cancel()
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, application/problem+json")
	for name, values := range c.cfg.creds[p.client-1] {
		req.Header[name] = values
	}
	if p.key != "" {
		k := p.key
		if p.sf {
			k = `"` + k + `"`
		}
		req.Header[keyHeaderName] = []string{k}
	}
	if !p.firstSent.IsZero() {
		req.Header.Set(firstSentHeader, p.firstSent.UTC().Format(http.TimeFormat))
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		cancel()
		return nil, err
	}
	resp.Body = &cancelOnClose{resp.Body, cancel}
	return resp, nil
}

// refusedBy is the finding's reason for a request p whose credentials r
// refused.
func refusedBy(p *probe, r *reply) string {
	return fmt.Sprintf("credentials refused: client %d got %s", p.client, r)
}

// cancelOnClose cancels a request's context once its body is closed.
type cancelOnClose struct {
	io.ReadCloser
	cancel context.CancelFunc
}

func (b *cancelOnClose) Close() error {
	err := b.ReadCloser.Close()
	b.cancel()
	return err
}

// sendAll sends probes in order and returns their replies, or the verdict
// that ends the row early: the budget is spent, every request so far was
// refused, or ctx is done. A probe that got no answer (no connection, a
// timeout) or whose credentials were refused (401, 403) ends the row as
// not checkable: the server said nothing about the contract.
func (c *checker) sendAll(ctx context.Context, probes ...*probe) ([]*reply, *finding) {
	var rs []*reply
	for _, p := range probes {
		r, err := c.send(ctx, p)
		if v := stopVerdict(c, err); v != nil {
			return nil, v
		}
		if v := unanswered(p, r); v != nil {
			return nil, v
		}
		rs = append(rs, r)
	}
	return rs, nil
}

// unanswered returns the verdict for a probe p whose reply r says nothing
// about the contract (no answer, or credentials refused), or nil.
func unanswered(p *probe, r *reply) *finding {
	switch {
	case r.err != nil:
		return &finding{notCheckable, r.String()}
	case r.refused():
		return &finding{notCheckable, refusedBy(p, r)}
	}
	return nil
}

func stopVerdict(c *checker, err error) *finding {
	switch {
	case errors.Is(err, errBudget):
		return &finding{notCheckable, fmt.Sprintf("%s %d reached: its requests could make more %ss", c.cfg.maxFlag(), c.cfg.maxOps, c.cfg.noun())}
	case errors.Is(err, errRefused):
		refusal, _ := c.refusedAll()
		return &finding{notCheckable, refusal}
	case err != nil:
		return &finding{notCheckable, err.Error()}
	}
	return nil
}

// planConformance returns the rows of the check for cfg, with the keys of
// their probes. Rows are judged in order, and a later row may rest on an
// earlier one's finding: the replay row says whether the server is seen to
// keep a key at all.
func planConformance(cfg conformanceConfig) []*row {
	noun := cfg.noun()
	other := otherBody(cfg.body)
	k1, k2, k3, k4, k5, k6 := idem.NewKey(), idem.NewKey(), idem.NewKey(), idem.NewKey(), idem.NewKey(), idem.NewKey()
	long := idem.NewKey() + "-"
	long += strings.Repeat("x", idem.MaxKeyLen-len(long))

	first := &probe{label: "K1, the body", client: 1, key: k1, body: cfg.body}
	firstOK := func(c *checker) *finding {
		r := c.replies[first]
		switch {
		case r == nil:
			return &finding{notCheckable, "the first request with K1 was not sent"}
		case r.refused():
			return &finding{notCheckable, refusedBy(first, r)}
		case !r.ok2xx():
			return &finding{notCheckable, "the first request with K1 did not succeed: " + r.String()}
		case cfg.retention > 0 && time.Since(r.sentAt.Add(r.elapsed)) > cfg.retention/2:
			return &finding{notCheckable, "K1 may be near the end of its retention"}
		}
		return nil
	}

	// afterFirst sends p, which needs K1's first request to have
	// succeeded, and returns its reply, or why it was not sent.
	afterFirst := func(ctx context.Context, c *checker, p *probe) (*reply, *finding) {
		if v := firstOK(c); v != nil {
			return nil, v
		}
		rs, v := c.sendAll(ctx, p)
		if v != nil {
			return nil, v
		}
		return rs[0], nil
	}

	// replay is the replay row's finding: the premise of every row that
	// expects a key to be kept.
	replay := finding{notCheckable, "the replay row did not run"}
	needReplay := func(c *checker, what string) *finding {
		if replay.kind == conforms {
			return nil
		}
		if refusal, all := c.refusedAll(); all {
			return &finding{notCheckable, refusal}
		}
		return &finding{notCheckable, "K1 was not seen replayed (see replay): " + what}
	}

	var rows []*row

	noKey := &probe{label: "no key, the body", client: 1, body: cfg.body}
	rows = append(rows, &row{
		name: "key required", rule: fmt.Sprintf("a %s without a key gets 400 with problem+json", cfg.method),
		probes: []*probe{first, noKey},
		judge: func(ctx context.Context, c *checker) finding {
			rs, v := c.sendAll(ctx, first)
			if v != nil {
				return *v
			}
			if !rs[0].ok2xx() {
				return finding{notCheckable, "the body was not accepted with a key either: " + rs[0].String() + "; pass a -body the target accepts"}
			}
			if rs, v = c.sendAll(ctx, noKey); v != nil {
				return *v
			}
			r := rs[0]
			switch {
			case r.status == http.StatusBadRequest && mediaType(r) == problemJSON:
				return finding{conforms, r.String()}
			case r.status == http.StatusBadRequest:
				return finding{differs, "400, but not application/problem+json: " + r.String()}
			case r.ok2xx():
				return finding{differs, "accepted without a key, a " + noun + " no retry can find: " + r.String()}
			}
			return finding{differs, r.String()}
		},
	})

	again := &probe{label: "K1 again, the same body", client: 1, key: k1, body: cfg.body}
	fresh := &probe{label: "K2, the body", client: 1, key: k2, body: cfg.body,
		when: "only if K1's replay has no " + replayHeader + ": true; a new key must get another answer"}
	rows = append(rows, &row{
		name: "replay", rule: "a completed request sent again gets the same status and body (and a replay marker, if the API has one)",
		probes: []*probe{again, fresh},
		judge: func(ctx context.Context, c *checker) finding {
			replay = func() finding {
				r, v := afterFirst(ctx, c, again)
				if v != nil {
					return *v
				}
				one := c.replies[first]
				switch {
				case !r.same(one) && r.ok2xx():
					return finding{differs, "another answer, " + r.String() + ": the request ran twice"}
				case !r.same(one):
					return finding{differs, r.String()}
				case r.replayMarked(one):
					return finding{conforms, "same status and body, " + replayHeader + ": " + r.header.Get(replayHeader)}
				}
				// The same answer and no marker: a replay, unless every
				// operation gets this answer.
				rs, v := c.sendAll(ctx, fresh)
				if v != nil {
					return *v
				}
				switch {
				case !rs[0].ok2xx():
					return finding{notCheckable, "a new key with the body got " + rs[0].String() + ", and no replay marker: a replay cannot be told from a second execution"}
				case rs[0].same(one):
					return finding{notCheckable, "a new key with the body got the same answer, and no replay marker: a replay cannot be told from a second execution"}
				}
				return finding{conforms, "same status and body; no replay marker, and a new key got another answer"}
			}()
			return replay
		},
	})

	// advertised is the retention K1's first answer advertised, if it
	// did; the late-retry row's horizon.
	var advertised time.Duration
	rows = append(rows, &row{
		name: "advertised retention", rule: "every keyed answer says how long its key is kept (" + ttlHeader + ", in seconds)",
		judge: func(ctx context.Context, c *checker) finding {
			if v := firstOK(c); v != nil {
				return *v
			}
			v := c.replies[first].header.Values(ttlHeader)
			if len(v) == 0 {
				return finding{differs, "K1's answer has no " + ttlHeader + ": a client cannot tell how long it may retry"}
			}
			secs, err := strconv.ParseInt(v[0], 10, 64)
			if len(v) > 1 || err != nil || secs <= 0 || secs > math.MaxInt64/int64(time.Second) {
				return finding{differs, fmt.Sprintf("%s: %q is not a number of seconds", ttlHeader, v)}
			}
			advertised = time.Duration(secs) * time.Second
			if cfg.retention > 0 && advertised != cfg.retention {
				return finding{differs, fmt.Sprintf("%s: %d (%s), but -retention says %s", ttlHeader, secs, advertised, cfg.retention)}
			}
			return finding{conforms, fmt.Sprintf("%s: %d (%s)", ttlHeader, secs, advertised)}
		},
	})

	late := &probe{label: "K6, the body, first sent before the retention", client: 1, key: k6, body: cfg.body,
		when: "its " + firstSentHeader + " an hour older than the retention"}
	lateRow := &row{
		name: "late retry", rule: "a request first sent longer ago than the retention, whose key the API no longer has, gets 410 and is not run",
		probes: []*probe{late},
		judge: func(ctx context.Context, c *checker) finding {
			if refusal, all := c.refusedAll(); all {
				return finding{notCheckable, refusal}
			}
			horizon := cmp.Or(advertised, cfg.retention)
			if horizon <= 0 {
				return finding{notCheckable, "the retention is not known: no " + ttlHeader + " on K1's answer, and no -retention"}
			}
			late.firstSent = time.Now().Add(-horizon - time.Hour)
			rs, v := c.sendAll(ctx, late)
			if v != nil {
				return *v
			}
			switch r := rs[0]; {
			case r.status == http.StatusGone:
				return finding{conforms, r.String()}
			case r.ok2xx():
				return finding{differs, "ran it, " + r.String() + ": a retry that arrives after its key was purged would run again"}
			default:
				return finding{differs, r.String() + ", not 410"}
			}
		},
	}
	rows = append(rows, lateRow)

	changed := &probe{label: "K1, another body", client: 1, key: k1, body: other}
	control := &probe{label: "K3, another body", client: 1, key: k3, body: other,
		when: "only if K1 with another body gets 422; another body must be accepted with a new key"}
	rows = append(rows, &row{
		name: "another body", rule: "the key with another body gets 422",
		probes: []*probe{changed, control},
		judge: func(ctx context.Context, c *checker) finding {
			r, v := afterFirst(ctx, c, changed)
			if v != nil {
				return *v
			}
			kept := replay.kind == conforms
			switch {
			case r.status == http.StatusUnprocessableEntity:
				rs, v := c.sendAll(ctx, control)
				if v != nil {
					return *v
				}
				if !rs[0].ok2xx() {
					return finding{notCheckable, "another body is not accepted with a new key either: " + rs[0].String() + ": the 422 may not be about the key"}
				}
				return finding{conforms, r.String()}
			case kept && r.same(c.replies[first]):
				return finding{differs, "replayed the first answer: the body is not compared"}
			case kept && r.ok2xx():
				return finding{differs, "a new " + noun + " under a used key: " + r.String()}
			}
			return finding{differs, r.String() + ", not 422"}
		},
	})

	sf := &probe{label: `"K1" (sf-string), the body`, client: 1, key: k1, sf: true, body: cfg.body}
	rows = append(rows, &row{
		name: "sf-string key", rule: `the sf-string "K1" is the key K1: a replay`,
		probes: []*probe{sf},
		judge: func(ctx context.Context, c *checker) finding {
			if v := needReplay(c, "no replay to expect"); v != nil {
				return *v
			}
			r, v := afterFirst(ctx, c, sf)
			if v != nil {
				return *v
			}
			switch {
			case r.same(c.replies[first]):
				return finding{conforms, "replayed K1's answer"}
			case r.ok2xx():
				return finding{differs, "a new " + noun + ": the quotes were taken as part of another key"}
			}
			return finding{differs, "refused the sf-string form: " + r.String()}
		},
	})

	other2 := &probe{label: "K1 from client 2, the body", client: 2, key: k1, body: cfg.body}
	perClient := &row{
		name: "per client", rule: "keys are scoped by client: client 2's K1 is a new operation",
		probes: []*probe{other2},
		judge: func(ctx context.Context, c *checker) finding {
			if v := needReplay(c, "client 2's answer shows nothing of scoping"); v != nil {
				return *v
			}
			r, v := afterFirst(ctx, c, other2)
			if v != nil {
				return *v
			}
			switch {
			case r.same(c.replies[first]):
				return finding{differs, "replayed client 1's answer to client 2: keys are shared by all clients"}
			case r.ok2xx():
				return finding{conforms, "a" + an(noun) + " " + noun + " of client 2's own: " + r.String()}
			case r.status == http.StatusUnprocessableEntity || r.status == http.StatusConflict:
				return finding{differs, "client 1's key blocks client 2: " + r.String()}
			}
			return finding{differs, r.String()}
		},
	}
	if len(cfg.creds[1]) == 0 {
		perClient.skip = "needs -token2 or -header2, the credentials of a second client of the API"
	}
	rows = append(rows, perClient)

	at255 := &probe{label: fmt.Sprintf("a key of %d characters", len(long)), client: 1, key: long, body: cfg.body}
	at256 := &probe{label: fmt.Sprintf("a key of %d characters", len(long)+1), client: 1, key: long + "x", body: cfg.body}
	rows = append(rows, &row{
		name: "key length", rule: "a key of 255 characters is accepted, one of 256 refused with 400",
		probes: []*probe{at255, at256},
		judge: func(ctx context.Context, c *checker) finding {
			rs, v := c.sendAll(ctx, at255, at256)
			if v != nil {
				return *v
			}
			var bad []string
			if !rs[0].ok2xx() {
				bad = append(bad, "255 refused: "+rs[0].String())
			}
			if rs[1].status != http.StatusBadRequest {
				bad = append(bad, "256 not refused with 400: "+rs[1].String())
			}
			if bad != nil {
				return finding{differs, strings.Join(bad, "; ")}
			}
			return finding{conforms, "255 accepted, 256 refused with 400"}
		},
	})

	slowFirst := &probe{label: "K4, the slow body", client: 1, key: k4, body: cfg.slowBody}
	slowDup := &probe{label: "K4 again while the first runs", client: 1, key: k4, body: cfg.slowBody,
		when: fmt.Sprintf("%s after the first, while it runs", inFlightAfter)}
	inFlight := &row{
		name: "in flight", rule: "a duplicate while the first request runs gets 409 with Retry-After",
		probes: []*probe{slowFirst, slowDup},
		judge: func(ctx context.Context, c *checker) finding {
			type sent struct {
				r   *reply
				err error
			}
			done := make(chan sent, 1)
			go func() {
				r, err := c.send(ctx, slowFirst)
				done <- sent{r, err}
			}()
			t := time.NewTimer(inFlightAfter)
			defer t.Stop()
			select {
			case s := <-done:
				if v := stopVerdict(c, s.err); v != nil {
					return *v
				}
				if v := unanswered(slowFirst, s.r); v != nil {
					return *v
				}
				return finding{notCheckable, fmt.Sprintf("the slow body was answered in %s, before the duplicate was due: it must take over a second", s.r.elapsed.Round(time.Millisecond))}
			case <-t.C:
			}
			dup, err := c.send(ctx, slowDup)
			s := <-done
			if v := stopVerdict(c, cmp.Or(s.err, err)); v != nil {
				return *v
			}
			if v := cmp.Or(unanswered(slowFirst, s.r), unanswered(slowDup, dup)); v != nil {
				return *v
			}
			firstEnded := s.r.sentAt.Add(s.r.elapsed)
			switch {
			case dup.status == http.StatusConflict && dup.header.Get("Retry-After") != "":
				return finding{conforms, dup.String()}
			case dup.status == http.StatusConflict:
				return finding{differs, "409 without Retry-After"}
			case s.r.status == http.StatusConflict && dup.ok2xx():
				// The duplicate reached the server first (a slow network,
				// a busy client): the first request was the one that came
				// while the other ran.
				if s.r.header.Get("Retry-After") == "" {
					return finding{differs, "409 without Retry-After (to the first request, which arrived second)"}
				}
				return finding{conforms, s.r.String() + ", to the first request, which arrived second"}
			case dup.ok2xx() && dup.same(s.r) && dup.sentAt.Add(dup.elapsed).After(firstEnded):
				return finding{differs, fmt.Sprintf("held the duplicate %s until the first ended, then replayed it: no 409", dup.elapsed.Round(time.Millisecond))}
			case dup.ok2xx() && s.r.ok2xx():
				return finding{differs, "ran the duplicate as well: two answers, two " + noun + "s"}
			}
			return finding{differs, dup.String()}
		},
	}
	if cfg.slowBody == nil {
		inFlight.skip = "needs -slow-body: a body the target takes over a second to process (see docs/conformance.md)"
	}
	rows = append(rows, inFlight)

	margin := min(cfg.retention/10, 10*time.Second)
	keep := &probe{label: "K5, the body", client: 1, key: k5, body: cfg.body}
	within := &probe{label: "K5 again, before the retention ends", client: 1, key: k5, body: cfg.body,
		when: fmt.Sprintf("%s after K5 was sent", cfg.retention-margin)}
	after := &probe{label: "K5 again, after the retention", client: 1, key: k5, body: cfg.body,
		when: fmt.Sprintf("%s after K5's answer", cfg.retention+margin)}
	ret := &row{
		name: "retention", rule: "a key is kept for the retention the API publishes",
		probes: []*probe{keep, within, after},
		judge: func(ctx context.Context, c *checker) finding {
			if v := needReplay(c, "no key kept to time"); v != nil {
				return *v
			}
			rs, v := c.sendAll(ctx, keep)
			if v != nil {
				return *v
			}
			if !rs[0].ok2xx() {
				return finding{notCheckable, "the first request with K5 did not succeed: " + rs[0].String()}
			}
			// The key's retention began between K5's sending and its
			// answer: the request within it is due a margin before it
			// ends counted from the sending, the one after it a margin
			// after it ends counted from the answer.
			sent, answered := rs[0].sentAt, rs[0].sentAt.Add(rs[0].elapsed)
			if err := sleep(ctx, time.Until(sent.Add(cfg.retention-margin))); err != nil {
				return finding{notCheckable, err.Error()}
			}
			if rs, v = c.sendAll(ctx, within); v != nil {
				return *v
			}
			if r := rs[0]; !r.same(c.replies[keep]) {
				if late := r.sentAt.Add(r.elapsed).Sub(sent); late > cfg.retention {
					// The server may have read it after the retention.
					return finding{notCheckable, fmt.Sprintf("K5 again was answered %s after K5 was sent, past the %s retention: it may have come too late",
						late.Round(time.Millisecond), cfg.retention)}
				}
				return finding{differs, fmt.Sprintf("forgot the key %s after K5 was sent, within the published %s: %s", cfg.retention-margin, cfg.retention, r)}
			}
			if err := sleep(ctx, time.Until(answered.Add(cfg.retention+margin))); err != nil {
				return finding{notCheckable, err.Error()}
			}
			if rs, v = c.sendAll(ctx, after); v != nil {
				return *v
			}
			var later string
			switch r := rs[0]; {
			case r.same(c.replies[keep]):
				later = "still replayed after the retention"
			case r.ok2xx():
				later = "a new " + noun + " after the retention"
			default:
				later = r.String() + " after the retention"
			}
			return finding{conforms, fmt.Sprintf("replayed %s after K5 was sent; %s", cfg.retention-margin, later)}
		},
	}
	switch {
	case cfg.retention <= 0:
		ret.skip = "pass -retention with the retention the API publishes (Stripe: 24h), and -wait to wait it out"
	case !cfg.wait:
		ret.skip = fmt.Sprintf("the published retention is %s; -wait waits it out (about %s)", cfg.retention, cfg.retention+margin)
	}
	rows = append(rows, ret)
	return rows
}

// an returns "n" if noun starts with a vowel, for "a" before it.
func an(noun string) string {
	if strings.ContainsRune("aeiou", rune(noun[0])) {
		return "n"
	}
	return ""
}

// mediaType returns the media type of r's Content-Type.
func mediaType(r *reply) string {
	mt, _, _ := mime.ParseMediaType(r.header.Get("Content-Type"))
	return mt
}

// otherBody returns body with one value changed: the first number (in key
// order) plus one, or else the first string with "-2" appended, so that
// the server sees another request of the same shape.
func otherBody(body []byte) []byte {
	var m map[string]any
	d := json.NewDecoder(bytes.NewReader(body))
	d.UseNumber()
	if d.Decode(&m) != nil {
		return append(slices.Clone(body), ' ') // validated by the flags: not reached
	}
	keys := slices.Sorted(func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	})
	changed := false
	for _, k := range keys {
		if n, ok := m[k].(json.Number); ok {
			if i, err := n.Int64(); err == nil {
				m[k] = i + 1
			} else {
				f, _ := n.Float64()
				m[k] = f + 1
			}
			changed = true
			break
		}
	}
	for _, k := range keys {
		if s, ok := m[k].(string); ok && !changed {
			m[k] = s + "-2"
			changed = true
		}
	}
	if !changed {
		m["idem_conformance"] = "another body"
	}
	out, _ := json.Marshal(m)
	return out
}

// checkBody validates a -body or -slow-body flag: a JSON object.
func checkBody(flagName, body string) ([]byte, error) {
	var m map[string]any
	if err := json.Unmarshal([]byte(body), &m); err != nil || m == nil {
		return nil, fmt.Errorf("%w: %s must be a JSON object, such as %s", errUsage, flagName, defaultConformanceBody)
	}
	return []byte(body), nil
}

// runConformance runs (or, with -dry-run, prints) the check and writes its
// report to w. It returns an error when a row differs, or when the target
// refused the credentials of every request.
func runConformance(ctx context.Context, cfg conformanceConfig, w io.Writer) error {
	rows := planConformance(cfg)
	requests := 0
	for _, r := range rows {
		if r.skip == "" {
			requests += len(r.probes)
		}
	}
	fmt.Fprintf(w, "idem conformance check of %s %s\n", cfg.method, cfg.target)
	fmt.Fprintf(w, "  at most %d requests, each sent once on a connection of its own; at most %d %ss (%s)\n", requests, cfg.maxOps, cfg.noun(), cfg.maxFlag())
	fmt.Fprintf(w, "  the body: %s\n", cfg.body)
	if cfg.dryRun {
		return writePlan(w, cfg, rows)
	}

	base := http.DefaultTransport.(*http.Transport).Clone()
	base.DisableKeepAlives = true // no request resent by net/http on a reused connection
	defer base.CloseIdleConnections()
	c := &checker{
		cfg: cfg,
		hc: &http.Client{Transport: base, CheckRedirect: func(*http.Request, []*http.Request) error {
			return http.ErrUseLastResponse
		}},
		out:     w,
		replies: make(map[*probe]*reply),
	}
	verdicts := make([]finding, len(rows))
	for i, r := range rows {
		fmt.Fprintf(w, "\n%d. %s: %s\n", i+1, r.name, r.rule)
		switch {
		case ctx.Err() != nil:
			verdicts[i] = finding{notCheckable, "interrupted"}
		case r.skip != "":
			verdicts[i] = finding{notCheckable, r.skip}
		default:
			verdicts[i] = r.judge(ctx, c)
		}
		fmt.Fprintf(w, "  %s\n", verdicts[i])
	}
	return writeVerdicts(w, c, rows, verdicts)
}

// writeVerdicts prints the table of verdicts and returns an error when a
// row differs, or when every request was refused.
func writeVerdicts(w io.Writer, c *checker, rows []*row, verdicts []finding) error {
	var b strings.Builder
	width := len("row")
	for _, r := range rows {
		width = max(width, len(r.name))
	}
	count := map[string]int{}
	fmt.Fprintf(&b, "\n%-*s  %s\n", width, "row", "verdict")
	for i, r := range rows {
		fmt.Fprintf(&b, "%-*s  %s\n", width, r.name, verdicts[i])
		count[verdicts[i].kind]++
	}
	fmt.Fprintf(&b, "%d conform, %d differ, %d not checkable; %d requests sent, at most %d %ss made (%s %d)\n",
		count[conforms], count[differs], count[notCheckable], c.sent, c.madeNow(), c.cfg.noun(), c.cfg.maxFlag(), c.cfg.maxOps)
	_, refusedAll := c.refusedAll()
	if refusedAll {
		b.WriteString("Every request was refused with 401 or 403: check the credentials (-token, -header, -token2, -header2).\n")
	}
	io.WriteString(w, b.String())
	switch n := count[differs]; {
	case n > 0:
		return fmt.Errorf("%d of %d rows differ from the contract", n, len(rows))
	case refusedAll:
		return errors.New("the target refused the credentials of every request (401 or 403): nothing was checked")
	}
	return nil
}

// writePlan prints the requests the check would send, and sends nothing.
func writePlan(w io.Writer, cfg conformanceConfig, rows []*row) error {
	fmt.Fprintf(w, "  -dry-run: nothing is sent. The requests, all %s %s with Content-Type: application/json;\n", cfg.method, cfg.target)
	fmt.Fprintf(w, "  client 1's credentials: %s; client 2's: %s\n", headerNames(cfg.creds[0]), headerNames(cfg.creds[1]))
	for i, r := range rows {
		fmt.Fprintf(w, "\n%d. %s: %s\n", i+1, r.name, r.rule)
		if r.skip != "" {
			fmt.Fprintf(w, "    none: %s\n", finding{notCheckable, r.skip})
			continue
		}
		for _, p := range r.probes {
			key := "no " + keyHeaderName
			switch {
			case p.sf:
				key = fmt.Sprintf("%s: %q", keyHeaderName, p.key)
			case p.key != "":
				key = keyHeaderName + ": " + p.key
			}
			line := fmt.Sprintf("    %s: client %d's credentials, %s, body %s", p.label, p.client, key, p.body)
			if p.when != "" {
				line += "; sent " + p.when
			}
			fmt.Fprintln(w, line)
		}
	}
	return nil
}

// headerNames lists the names of the headers in h (their values are
// credentials, not printed), or says there are none.
func headerNames(h http.Header) string {
	if len(h) == 0 {
		return "none"
	}
	return strings.Join(slices.Sorted(maps.Keys(h)), ", ")
}
