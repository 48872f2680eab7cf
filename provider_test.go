package idem

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fakeAnswer is one answer of a fake provider: a status, a JSON body and
// header name/value pairs.
type fakeAnswer struct {
	status int
	body   string
	header []string
}

func (a fakeAnswer) write(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "application/json")
	for i := 0; i+1 < len(a.header); i += 2 {
		w.Header().Set(a.header[i], a.header[i+1])
	}
	w.WriteHeader(a.status)
	io.WriteString(w, a.body)
}

// padded returns a with a JSON body grown past ProviderBodyLimit by a
// "padding" member, so that what the Provider read of it is only a part.
func padded(a fakeAnswer) fakeAnswer {
	a.body = strings.TrimSuffix(a.body, "}") + `,"padding":"` + strings.Repeat("p", 3*ProviderBodyLimit) + `"}`
	return a
}

// fakeRequest is a request as a fake provider saw it.
type fakeRequest struct {
	header http.Header
	body   string
	key    string
}

// providerFake is an httptest server on 127.0.0.1 that keeps a provider's
// idempotency promises as its documentation states them: a new key runs
// and gets created; the same key with the same body gets the stored
// answer again; the same key with another body gets the provider's
// key-reuse answer; a key in busy is still running elsewhere and gets the
// provider's in-progress answers until its count runs out. The answers in
// script go first to the first requests, whatever they carry.
type providerFake struct {
	keyOf   func(http.Header, []byte) string
	created fakeAnswer
	reuse   fakeAnswer
	running []fakeAnswer // in-progress answers, taken in turn

	mu     sync.Mutex
	script []fakeAnswer
	busy   map[string]int
	stored map[string]string
	reqs   []fakeRequest
}

func (f *providerFake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	key := f.keyOf(r.Header, body)
	f.mu.Lock()
	f.reqs = append(f.reqs, fakeRequest{r.Header.Clone(), string(body), key})
	a := f.answer(key, string(body))
	f.mu.Unlock()
	a.write(w)
}

func (f *providerFake) answer(key, body string) fakeAnswer {
	if len(f.script) > 0 {
		a := f.script[0]
		f.script = f.script[1:]
		return a
	}
	if n := f.busy[key]; n > 0 {
		f.busy[key] = n - 1
		return f.running[n%len(f.running)]
	}
	stored, ok := f.stored[key]
	switch {
	case !ok:
		f.stored[key] = body
	case stored != body:
		return f.reuse
	}
	return f.created
}

func (f *providerFake) requests() []fakeRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]fakeRequest(nil), f.reqs...)
}

// headerKey and bodyKey read the key where a provider takes it.
func headerKey(name string) func(http.Header, []byte) string {
	return func(h http.Header, _ []byte) string { return h.Get(name) }
}

func bodyKey(field string) func(http.Header, []byte) string {
	return func(_ http.Header, body []byte) string {
		var m map[string]any
		_ = json.Unmarshal(body, &m)
		s, _ := m[field].(string)
		return s
	}
}

// dialect is a built-in provider with the answers its documentation gives
// (bodies as the documented error objects; messages quoted from the docs
// or from answers seen in the wild where the docs give none).
type dialect struct {
	name    string
	p       Provider
	keyOf   func(http.Header, []byte) string
	created fakeAnswer
	// reuse is the answer to a key used for another request, nil if the
	// provider documents none (Adyen); reuseDetail its message.
	reuse       *fakeAnswer
	reuseDetail string
	// running are the answers to a request whose key is still running,
	// nil if the provider documents none (Square; AWS's Cloud Control
	// answers at once, DynamoDB's TransactWriteItems has one);
	// runningDetail the message of the last.
	running       []fakeAnswer
	runningDetail string
	// refused are answers the table alone would retry, wait out or turn
	// into a KeyReuseError, which the provider says to hand back as they
	// are.
	refused []fakeAnswer
	// retried are answers the table alone would hand back, which the
	// provider says to retry with the same key.
	retried []fakeAnswer
}

var dialects = []dialect{
	{
		name:    "Stripe",
		p:       Stripe,
		keyOf:   headerKey("Idempotency-Key"),
		created: fakeAnswer{status: 200, body: `{"id":"ch_1","object":"charge"}`},
		reuse: &fakeAnswer{status: 400, body: `{"error":{"message":"Keys for idempotent requests can only be used with the same parameters they were first used with. Try using a key other than 'order-1' if you meant to execute a different request.","type":"idempotency_error"}}`,
			header: []string{"Stripe-Should-Retry", "false"}},
		reuseDetail:   "Keys for idempotent requests can only be used with the same parameters they were first used with. Try using a key other than 'order-1' if you meant to execute a different request.",
		running:       []fakeAnswer{{status: 409, body: `{"error":{"code":"idempotency_key_in_use","doc_url":"https://stripe.com/docs/error-codes/idempotency-key-in-use","message":"There is currently another in-progress request using this Idempotent Key (that probably means you submitted twice, and the other request is still going through): order-1. Please try again later.","type":"invalid_request_error"}}`}},
		runningDetail: "There is currently another in-progress request using this Idempotent Key (that probably means you submitted twice, and the other request is still going through): order-1. Please try again later.",
		refused: []fakeAnswer{
			// A 500 the API says not to retry: "it won't have an additional effect".
			padded(fakeAnswer{status: 500, body: `{"error":{"type":"api_error","message":"An unknown error occurred"}}`, header: []string{"Stripe-Should-Retry", "false"}}),
		},
		retried: []fakeAnswer{
			// lock_timeout: "This object cannot be accessed right now because another API request or Stripe process is currently accessing it."
			{status: 400, body: `{"error":{"code":"lock_timeout","type":"invalid_request_error"}}`, header: []string{"Stripe-Should-Retry", "true"}},
		},
	},
	{
		name:    "Adyen",
		p:       Adyen,
		keyOf:   headerKey("Idempotency-Key"),
		created: fakeAnswer{status: 200, body: `{"pspReference":"993617895204576J","resultCode":"Authorised"}`},
		running: []fakeAnswer{
			{status: 422, body: `{"status":422,"errorCode":"704","message":"request already processed or in progress","errorType":"validation"}`, header: []string{"Transient-Error", "true"}},
			{status: 409, body: `{"status":409,"errorCode":"704","message":"request already processed or in progress","errorType":"validation"}`, header: []string{"Transient-Error", "true"}},
		},
		runningDetail: "request already processed or in progress",
		refused: []fakeAnswer{
			padded(fakeAnswer{status: 422, body: `{"status":422,"errorCode":"101","message":"Invalid card number","errorType":"validation","pspReference":"F7WCWRG6JPHR8HG2"}`}),
		},
	},
	{
		name:          "PayPal",
		p:             PayPal,
		keyOf:         headerKey("PayPal-Request-Id"),
		created:       fakeAnswer{status: 201, body: `{"id":"5O190127TN364715T","status":"CREATED"}`},
		reuse:         &fakeAnswer{status: 422, body: `{"name":"UNPROCESSABLE_ENTITY","details":[{"issue":"PAYPAL_REQUEST_ID_PREVIOUSLY_USED","description":"The PayPal-Request-ID has already been used for another request."}],"message":"The requested action could not be performed, semantically incorrect, or failed business validation.","debug_id":"b1d1f06c7246c"}`},
		reuseDetail:   "The PayPal-Request-ID has already been used for another request.",
		running:       []fakeAnswer{{status: 409, body: `{"name":"RESOURCE_CONFLICT","message":"The server has detected a conflict while processing this request.","details":[{"issue":"PREVIOUS_REQUEST_IN_PROGRESS","description":"A previous request on this resource is currently in progress. Please wait for sometime and try again. It is best to space out the initial and the subsequent request(s) to avoid receiving this error."}],"debug_id":"a8b1f06c7246c"}`}},
		runningDetail: "A previous request on this resource is currently in progress. Please wait for sometime and try again. It is best to space out the initial and the subsequent request(s) to avoid receiving this error.",
		refused: []fakeAnswer{
			padded(fakeAnswer{status: 422, body: `{"name":"UNPROCESSABLE_ENTITY","details":[{"issue":"INSTRUMENT_DECLINED","description":"The instrument presented was either declined by the processor or bank, or it can't be used for this payment."}],"message":"The requested action could not be performed, semantically incorrect, or failed business validation.","debug_id":"c2d1f06c7246c"}`}),
		},
	},
	{
		name:        "Square",
		p:           Square,
		keyOf:       bodyKey("idempotency_key"),
		created:     fakeAnswer{status: 200, body: `{"payment":{"id":"R2B3Z8WMVt3EAmzYWLZvz7Y69EbZY","status":"COMPLETED"}}`},
		reuse:       &fakeAnswer{status: 400, body: `{"errors":[{"category":"INVALID_REQUEST_ERROR","code":"IDEMPOTENCY_KEY_REUSED","detail":"The idempotency key can only be retried with the same request data."}]}`},
		reuseDetail: "The idempotency key can only be retried with the same request data.",
		refused: []fakeAnswer{
			padded(fakeAnswer{status: 409, body: `{"errors":[{"category":"INVALID_REQUEST_ERROR","code":"CONFLICT","detail":"Conflict"}]}`}),
			padded(fakeAnswer{status: 422, body: `{"errors":[{"category":"INVALID_REQUEST_ERROR","code":"UNPROCESSABLE_ENTITY","detail":"Unprocessable entity"}]}`}),
		},
	},
	{
		name:        "AWS",
		p:           AWS,
		keyOf:       bodyKey("ClientToken"),
		created:     fakeAnswer{status: 200, body: `{"ProgressEvent":{"OperationStatus":"IN_PROGRESS","RequestToken":"f3e2c5a1"}}`},
		reuse:       &fakeAnswer{status: 400, body: `{"__type":"com.amazonaws.cloudcontrol#ClientTokenConflictException","Message":"The specified client token has already been used in another resource request."}`},
		reuseDetail: "The specified client token has already been used in another resource request.",
		running: []fakeAnswer{{status: 400, body: `{"__type":"com.amazonaws.dynamodb.v20120810#TransactionInProgressException","message":"The transaction with the given request token is already in progress."}`,
			header: []string{"X-Amzn-ErrorType", "TransactionInProgressException"}}},
		runningDetail: "The transaction with the given request token is already in progress.",
		refused: []fakeAnswer{
			padded(fakeAnswer{status: 409, body: `{"message":"Another operation is being performed on this resource."}`, header: []string{"X-Amzn-ErrorType", "ConflictException:http://internal.amazon.com/coral/com.amazonaws.example/"}}),
		},
		retried: []fakeAnswer{
			{status: 400, body: `{"__type":"com.amazonaws.cloudcontrol#ThrottlingException","Message":"Rate exceeded"}`},
		},
	},
}

// start returns a fake of the dialect's API, and a Transport for it with
// the dialect's Provider and the fast test policy.
func (d dialect) start(t *testing.T, script ...fakeAnswer) (*providerFake, string, *Transport) {
	t.Helper()
	f := &providerFake{keyOf: d.keyOf, created: d.created, running: d.running, script: script,
		busy: map[string]int{}, stored: map[string]string{}}
	if d.reuse != nil {
		f.reuse = *d.reuse
	}
	srv := newServer(t, f)
	tr := newTransport(t, fastPolicy)
	tr.Provider = d.p
	return f, srv.URL, tr
}

// postJSON sends one POST of body to url through tr with ctx.
func postJSON(t *testing.T, tr http.RoundTripper, ctx context.Context, url, body string) (*http.Response, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	return tr.RoundTrip(req)
}

// TestProviderKeyReuse checks that each provider's answer to a key used
// for another request ends the call with a KeyReuseError carrying the
// provider's message, after one attempt. Adyen documents no such answer.
func TestProviderKeyReuse(t *testing.T) {
	for _, d := range dialects {
		if d.reuse == nil {
			continue
		}
		t.Run(d.name, func(t *testing.T) {
			f, url, tr := d.start(t)
			ctx := WithKey(context.Background(), "order-1")
			resp, err := postJSON(t, tr, ctx, url, `{"amount":4200}`)
			require.NoError(t, err)
			resp.Body.Close()

			resp, err = postJSON(t, tr, ctx, url, `{"amount":9900}`)
			var reuse *KeyReuseError
			require.ErrorAs(t, err, &reuse, "response %v", resp)
			assert.Equal(t, "order-1", reuse.Key)
			assert.Equal(t, 1, reuse.Attempts)
			assert.Equal(t, d.reuse.status, reuse.Problem.Status)
			assert.Equal(t, d.reuseDetail, reuse.Problem.Detail)
			reqs := f.requests()
			require.Len(t, reqs, 2)
			assert.Equal(t, "order-1", reqs[1].key)
		})
	}
}

// TestProviderInProgress checks that each provider's answer to a request
// whose key is still running is waited out and asked again with the same
// key, on the conflict budget: MaxAttempts 1 allows no retry, yet the
// call goes on until the first request's result comes.
func TestProviderInProgress(t *testing.T) {
	for _, d := range dialects {
		if d.running == nil {
			continue
		}
		t.Run(d.name, func(t *testing.T) {
			f, url, tr := d.start(t)
			tr.Retry.MaxAttempts = 1
			f.busy["order-1"] = 3
			resp, err := postJSON(t, tr, WithKey(context.Background(), "order-1"), url, `{"amount":4200}`)
			require.NoError(t, err)
			body, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			require.NoError(t, err)
			assert.Equal(t, d.created.status, resp.StatusCode)
			assert.JSONEq(t, d.created.body, string(body))
			reqs := f.requests()
			require.Len(t, reqs, 4)
			for _, r := range reqs {
				assert.Equal(t, "order-1", r.key)
				assert.Equal(t, reqs[0].body, r.body)
			}
		})
	}
}

// TestProviderInProgressEnds checks that a key that stays in progress ends
// the call with an InProgressError carrying the provider's message.
func TestProviderInProgressEnds(t *testing.T) {
	for _, d := range dialects {
		if d.running == nil {
			continue
		}
		t.Run(d.name, func(t *testing.T) {
			f, url, tr := d.start(t)
			tr.Retry.MaxConflictRetries = 1
			f.busy["order-1"] = 100
			_, err := postJSON(t, tr, WithKey(context.Background(), "order-1"), url, `{"amount":4200}`)
			var inprog *InProgressError
			require.ErrorAs(t, err, &inprog)
			assert.Equal(t, 2, inprog.Polls)
			require.NotNil(t, inprog.Problem)
			assert.Equal(t, d.runningDetail, inprog.Problem.Detail)
			assert.Len(t, f.requests(), 2)
		})
	}
}

// TestProviderRefusedAnswersAreReturned checks that an answer the provider
// says not to retry (or which is, in its dialect, neither a request still
// running nor key reuse) comes back after one attempt, as the server sent
// it: status, headers and the whole body, though the Provider read its
// start.
func TestProviderRefusedAnswersAreReturned(t *testing.T) {
	for _, d := range dialects {
		for _, a := range d.refused {
			t.Run(d.name+"/"+http.StatusText(a.status), func(t *testing.T) {
				f, url, tr := d.start(t, a)
				resp, err := postJSON(t, tr, context.Background(), url, `{"amount":4200}`)
				require.NoError(t, err)
				body, err := io.ReadAll(resp.Body)
				require.NoError(t, err)
				require.NoError(t, resp.Body.Close())
				assert.Equal(t, a.status, resp.StatusCode)
				assert.Greater(t, len(body), ProviderBodyLimit)
				assert.Equal(t, a.body, string(body), "the body as the server sent it")
				assert.Len(t, f.requests(), 1)
			})
		}
	}
}

// TestProviderRetriedAnswers checks that an answer the provider says to
// retry, which the table alone would hand back, is retried with the same
// key.
func TestProviderRetriedAnswers(t *testing.T) {
	for _, d := range dialects {
		for _, a := range d.retried {
			t.Run(d.name+"/"+http.StatusText(a.status), func(t *testing.T) {
				f, url, tr := d.start(t, a)
				resp, err := postJSON(t, tr, context.Background(), url, `{"amount":4200}`)
				require.NoError(t, err)
				resp.Body.Close()
				assert.Equal(t, d.created.status, resp.StatusCode)
				reqs := f.requests()
				require.Len(t, reqs, 2)
				assert.NotEmpty(t, reqs[0].key)
				assert.Equal(t, reqs[0].key, reqs[1].key)
			})
		}
	}
}

// TestProviderKeyPlacement checks that each provider's key goes where its
// documentation says, and nowhere else.
func TestProviderKeyPlacement(t *testing.T) {
	for _, d := range dialects {
		t.Run(d.name, func(t *testing.T) {
			f, url, tr := d.start(t)
			resp, err := postJSON(t, tr, context.Background(), url, `{"amount":4200}`)
			require.NoError(t, err)
			resp.Body.Close()
			reqs := f.requests()
			require.Len(t, reqs, 1)
			assert.Len(t, reqs[0].key, 36, "a new UUIDv4, where the provider takes it")
			header := "" // the one header that carries the key
			if d.p.KeyBodyField == "" {
				header = cmp.Or(d.p.KeyHeader, DefaultKeyHeader)
				assert.JSONEq(t, `{"amount":4200}`, reqs[0].body, "the body as it was")
			}
			for _, h := range []string{DefaultKeyHeader, "PayPal-Request-Id"} {
				if h != header {
					assert.Empty(t, reqs[0].header.Get(h), h)
				}
			}
		})
	}
}

// TestProviderCallerSettingsWin checks that KeyHeader, KeyBodyField,
// KeyFormat and Classify set on the Transport win over the Provider's.
func TestProviderCallerSettingsWin(t *testing.T) {
	t.Run("KeyHeader", func(t *testing.T) {
		d := dialects[2] // PayPal
		f, url, tr := d.start(t)
		tr.KeyHeader = "X-Request-Id"
		resp, err := postJSON(t, tr, WithKey(context.Background(), "order-1"), url, `{}`)
		require.NoError(t, err)
		resp.Body.Close()
		h := f.requests()[0].header
		assert.Equal(t, "order-1", h.Get("X-Request-Id"))
		assert.Empty(t, h.Get("PayPal-Request-Id"))
	})
	t.Run("KeyBodyField", func(t *testing.T) {
		d := dialects[3] // Square
		f, url, tr := d.start(t)
		tr.KeyBodyField = "reference_id"
		resp, err := postJSON(t, tr, WithKey(context.Background(), "order-1"), url, `{"amount":4200}`)
		require.NoError(t, err)
		resp.Body.Close()
		assert.JSONEq(t, `{"reference_id":"order-1","amount":4200}`, f.requests()[0].body)
	})
	t.Run("KeyFormat", func(t *testing.T) {
		d := dialects[0] // Stripe, with a Provider that writes sf-strings
		f, url, tr := d.start(t)
		tr.Provider.KeyFormat = KeySFString
		send := func() string {
			resp, err := postJSON(t, tr, WithKey(context.Background(), "order-1"), url, `{}`)
			require.NoError(t, err)
			resp.Body.Close()
			reqs := f.requests()
			return reqs[len(reqs)-1].header.Get("Idempotency-Key")
		}
		assert.Equal(t, `"order-1"`, send(), "the Provider's format when the Transport sets none")
		tr.Provider.KeyFormat, tr.KeyFormat = KeyBare, KeySFString
		assert.Equal(t, `"order-1"`, send(), "the Transport's format")
	})
	t.Run("Classify", func(t *testing.T) {
		d := dialects[0] // Stripe
		var saw []Verdict
		stopAll := func(resp *http.Response, err error) Verdict { return VerdictStop }
		keep := func(resp *http.Response, err error) Verdict {
			saw = append(saw, VerdictDefault)
			return VerdictDefault
		}
		for _, c := range []struct {
			name     string
			classify func(*http.Response, error) Verdict
			reuse    bool
		}{
			{"overrides", stopAll, false},
			{"VerdictDefault keeps the Provider's verdict", keep, true},
		} {
			t.Run(c.name, func(t *testing.T) {
				_, url, tr := d.start(t, *d.reuse)
				tr.Classify = c.classify
				resp, err := postJSON(t, tr, context.Background(), url, `{}`)
				var reuse *KeyReuseError
				if c.reuse {
					require.ErrorAs(t, err, &reuse)
					return
				}
				require.NoError(t, err)
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				assert.Equal(t, 400, resp.StatusCode)
				assert.Equal(t, d.reuse.body, string(body), "Classify sees the body unread")
			})
		}
		assert.Len(t, saw, 1)
	})
}

// readLog is a response body that records whether it was read before a
// point, and reads from data.
type readLog struct {
	r     io.Reader
	reads int
}

func (b *readLog) Read(p []byte) (int, error) { b.reads++; return b.r.Read(p) }
func (b *readLog) Close() error               { return nil }

// TestProviderReadsOnlyWhatItNeeds checks that the Provider reads no body
// but those of the 4xx statuses it lists: not a 2xx, not another 4xx, not a
// 5xx.
func TestProviderReadsOnlyWhatItNeeds(t *testing.T) {
	for _, c := range []struct {
		status int
		read   bool
	}{
		{200, false}, {201, false}, {402, false}, {403, false}, {503, false}, {500, false},
		{400, true}, {404, true},
	} {
		t.Run(http.StatusText(c.status), func(t *testing.T) {
			data := `{"error":{"type":"card_error","message":"Your card was declined."}}`
			body := &readLog{r: strings.NewReader(data)}
			base := roundTripFunc(func(req *http.Request) (*http.Response, error) {
				resp := statusResponse(c.status)
				resp.Body, resp.ContentLength, resp.Request = body, -1, req
				return resp, nil
			})
			tr := &Transport{Base: base, Provider: Stripe, Retry: RetryPolicy{MaxAttempts: 1}}
			resp, err := postJSON(t, tr, context.Background(), "https://api.stripe.test/v1/charges", `{}`)
			require.NoError(t, err)
			assert.Equal(t, c.read, body.reads > 0, "body read before RoundTrip returned")
			got, err := io.ReadAll(resp.Body)
			require.NoError(t, err)
			assert.Equal(t, data, string(got))
		})
	}
}

// TestProviderReadsNo5xxNor2xx checks that a Provider that lists 2xx and
// 5xx statuses in BodyStatuses still gets no body of theirs: only 4xx
// bodies are read.
func TestProviderReadsNo5xxNor2xx(t *testing.T) {
	for _, status := range []int{200, 201, 500, 503, 400} {
		body := &readLog{r: strings.NewReader(`{}`)}
		base := roundTripFunc(func(req *http.Request) (*http.Response, error) {
			resp := statusResponse(status)
			resp.Body, resp.ContentLength, resp.Request = body, -1, req
			return resp, nil
		})
		var got []byte
		p := Provider{
			BodyStatuses: []int{200, 201, 500, 503, 400},
			Classify:     func(_ *http.Response, body []byte) Verdict { got = body; return VerdictStop },
		}
		tr := &Transport{Base: base, Provider: p, Retry: RetryPolicy{MaxAttempts: 1}}
		resp, err := postJSON(t, tr, context.Background(), "https://api.example.test/v1/payments", `{}`)
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, status == 400, body.reads > 0, "%d: body read", status)
		assert.Equal(t, status == 400, got != nil, "%d: Classify got a body", status)
	}
}

// TestProviderFirstTryAllocs checks that a Provider costs a first-try
// success no allocation: its bodies are not read, its rules not run. (Half
// an allocation apart is the same: see allocsPerRun.)
func TestProviderFirstTryAllocs(t *testing.T) {
	allocs := func(tr *Transport) float64 { return firstTryAllocs(t, tr, false) } // firsttry_test.go
	without := allocs(&Transport{Base: roundTripFunc(benchBase)})
	for _, d := range dialects {
		if d.p.KeyBodyField != "" {
			continue // a body field costs its own allocations, Provider or not
		}
		with := allocs(&Transport{Base: roundTripFunc(benchBase), Provider: d.p})
		assert.Less(t, with, without+headerRenameAllocs(d.p)+0.5, d.name)
	}
	field := allocs(&Transport{Base: roundTripFunc(benchBase), KeyBodyField: "idempotency_key"})
	assert.InDelta(t, field, allocs(&Transport{Base: roundTripFunc(benchBase), Provider: Square}), 0.5, "Square")
	field = allocs(&Transport{Base: roundTripFunc(benchBase), KeyBodyField: "ClientToken"})
	assert.InDelta(t, field, allocs(&Transport{Base: roundTripFunc(benchBase), Provider: AWS}), 0.5, "AWS")
}

// headerRenameAllocs is what a key header other than the default costs,
// with or without a Provider: its name is canonicalized per call.
func headerRenameAllocs(p Provider) float64 {
	if p.KeyHeader == "" {
		return 0
	}
	return testing.AllocsPerRun(10, func() { _ = (&Transport{KeyHeader: p.KeyHeader}).keyHeader() })
}

// TestProviderZeroValueIsTheDraft checks that a Transport without a
// Provider keeps the IETF draft's table: 422 is key reuse, a 400 is
// returned whatever its body says.
func TestProviderZeroValueIsTheDraft(t *testing.T) {
	d := dialects[0] // a Stripe fake, spoken to without the Stripe Provider
	_, url, tr := d.start(t, *d.reuse, fakeAnswer{status: 422, body: `{"detail":"another body"}`})
	tr.Provider = Provider{}
	resp, err := postJSON(t, tr, context.Background(), url, `{}`)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, 400, resp.StatusCode)
	_, err = postJSON(t, tr, context.Background(), url, `{}`)
	var reuse *KeyReuseError
	require.ErrorAs(t, err, &reuse)
	assert.Equal(t, "another body", reuse.Problem.Detail)
}

// TestProviderVerdicts is the table of each built-in provider's rules, as
// docs/providers.md lists them: a response's status, headers and body, and the
// verdict.
func TestProviderVerdicts(t *testing.T) {
	for _, c := range []struct {
		p      Provider
		status int
		header []string
		body   string
		want   Verdict
	}{
		{Stripe, 400, nil, `{"error":{"type":"idempotency_error","message":"m"}}`, VerdictKeyReuse},
		{Stripe, 404, nil, `{"error":{"type":"idempotency_error"}}`, VerdictKeyReuse},
		{Stripe, 400, []string{"Stripe-Should-Retry", "true"}, `{"error":{"type":"idempotency_error"}}`, VerdictKeyReuse},
		{Stripe, 409, nil, `{"error":{"code":"idempotency_key_in_use","type":"invalid_request_error"}}`, VerdictConflict},
		{Stripe, 409, []string{"Stripe-Should-Retry", "true"}, ``, VerdictConflict},
		{Stripe, 409, []string{"Stripe-Should-Retry", "false"}, `{"error":{"code":"idempotency_key_in_use"}}`, VerdictStop},
		{Stripe, 409, nil, `{"error":{"code":"resource_already_exists"}}`, VerdictDefault},
		{Stripe, 400, []string{"Stripe-Should-Retry", "true"}, ``, VerdictRetry},
		{Stripe, 503, []string{"Stripe-Should-Retry", "False"}, ``, VerdictStop},
		{Stripe, 400, nil, `{"error":{"type":"invalid_request_error"}}`, VerdictDefault},
		{Stripe, 422, nil, ``, VerdictDefault},

		{Adyen, 422, nil, `{"status":422,"errorCode":"704","message":"request already processed or in progress"}`, VerdictConflict},
		{Adyen, 409, nil, `{"errorCode":"704"}`, VerdictConflict},
		{Adyen, 409, nil, `{"errorCode":704}`, VerdictConflict},
		{Adyen, 422, nil, `{"status":422,"errorCode":"101","message":"Invalid card number"}`, VerdictStop},
		{Adyen, 409, nil, `{"errorCode":"000"}`, VerdictStop},
		{Adyen, 400, []string{"Transient-Error", "true"}, ``, VerdictRetry},
		{Adyen, 503, []string{"Transient-Error", "true"}, ``, VerdictRetry},
		{Adyen, 400, nil, `{"errorCode":"704"}`, VerdictConflict},
		{Adyen, 500, nil, ``, VerdictDefault},

		{PayPal, 422, nil, `{"name":"UNPROCESSABLE_ENTITY","details":[{"issue":"PAYPAL_REQUEST_ID_PREVIOUSLY_USED"}]}`, VerdictKeyReuse},
		{PayPal, 400, nil, `{"name":"DUPLICATE_REQUEST_ID","message":"The value of PayPal-Request-Id header has already been used"}`, VerdictKeyReuse},
		{PayPal, 409, nil, `{"details":[{"issue":"OTHER"},{"issue":"PREVIOUS_REQUEST_IN_PROGRESS"}]}`, VerdictConflict},
		{PayPal, 422, nil, `{"name":"UNPROCESSABLE_ENTITY","details":[{"issue":"INSTRUMENT_DECLINED"}]}`, VerdictStop},
		{PayPal, 409, nil, `{"name":"RESOURCE_CONFLICT"}`, VerdictStop},
		{PayPal, 400, nil, `{"name":"INVALID_REQUEST"}`, VerdictDefault},

		{Square, 400, nil, `{"errors":[{"category":"INVALID_REQUEST_ERROR","code":"IDEMPOTENCY_KEY_REUSED"}]}`, VerdictKeyReuse},
		{Square, 400, nil, `{"errors":[{"code":"INVALID_VALUE"},{"code":"IDEMPOTENCY_KEY_REUSED"}]}`, VerdictKeyReuse},
		{Square, 409, nil, `{"errors":[{"code":"CONFLICT"}]}`, VerdictStop},
		{Square, 422, nil, `{"errors":[{"code":"UNPROCESSABLE_ENTITY"}]}`, VerdictStop},
		{Square, 400, nil, `{"errors":[{"code":"INVALID_VALUE"}]}`, VerdictDefault},

		{AWS, 400, nil, `{"__type":"com.amazonaws.cloudcontrol#ClientTokenConflictException"}`, VerdictKeyReuse},
		{AWS, 400, []string{"X-Amzn-ErrorType", "ClientTokenConflictException:http://internal.amazon.com/coral/com.amazonaws.cloudcontrol/"}, ``, VerdictKeyReuse},
		{AWS, 400, nil, `{"__type":"IdempotentParameterMismatchException"}`, VerdictKeyReuse},
		{AWS, 400, nil, `{"code":"IdempotentParameterMismatch"}`, VerdictKeyReuse},
		{AWS, 400, nil, `{"__type":"com.amazonaws.dynamodb.v20120810#TransactionInProgressException"}`, VerdictConflict},
		{AWS, 400, []string{"X-Amzn-ErrorType", "ThrottlingException"}, `{"__type":"ValidationException"}`, VerdictRetry},
		{AWS, 400, nil, `{"__type":"ValidationException"}`, VerdictDefault},
		{AWS, 409, []string{"X-Amzn-ErrorType", "ConflictException"}, ``, VerdictStop},
		{AWS, 422, nil, ``, VerdictStop},
	} {
		resp := statusResponse(c.status)
		for i := 0; i+1 < len(c.header); i += 2 {
			resp.Header.Set(c.header[i], c.header[i+1])
		}
		got := c.p.Classify(resp, []byte(c.body))
		assert.Equal(t, c.want, got, "%s: %d %v %s", c.p.Name, c.status, c.header, c.body)
	}
}

// TestProviderMessages checks each provider's Message on its error body,
// and that a body that is not one gives "".
func TestProviderMessages(t *testing.T) {
	for _, d := range dialects {
		if d.reuse != nil {
			assert.Equal(t, d.reuseDetail, d.p.Message([]byte(d.reuse.body)), d.name)
		}
		if d.running != nil {
			assert.Equal(t, d.runningDetail, d.p.Message([]byte(d.running[len(d.running)-1].body)), d.name)
		}
		assert.Empty(t, d.p.Message([]byte(`<html>502 Bad Gateway</html>`)), d.name)
		assert.Empty(t, d.p.Message(nil), d.name)
	}
}

func TestAWSErrorName(t *testing.T) {
	for in, want := range map[string]string{
		"ThrottlingException": "ThrottlingException",
		"com.amazonaws.cloudcontrol#ClientTokenConflictException":                            "ClientTokenConflictException",
		"ClientTokenConflictException:http://internal.amazon.com/coral/com.amazonaws.cc/":    "ClientTokenConflictException",
		"aws.protocoltests.restjson#FooError:http://internal.amazon.com/coral/com.amazon.c/": "FooError",
		" SlowDown ": "SlowDown",
		"":           "",
	} {
		assert.Equal(t, want, awsErrorName(in), in)
	}
}

// chunkReader returns data in reads of at most size bytes, then err (io.EOF
// if nil).
type chunkReader struct {
	data   []byte
	size   int
	err    error
	closed bool
}

func (r *chunkReader) Read(p []byte) (int, error) {
	if len(r.data) == 0 {
		if r.err != nil {
			return 0, r.err
		}
		return 0, io.EOF
	}
	n := copy(p[:min(len(p), r.size)], r.data)
	r.data = r.data[n:]
	return n, nil
}

func (r *chunkReader) Close() error { r.closed = true; return nil }

// checkPeek peeks n bytes of a body holding data, read size bytes at a time
// and ending in end (io.EOF if nil), and checks that the peek returns the
// start of data and the body gives back every byte of data, then end.
func checkPeek(t *testing.T, data []byte, size, n int, length int64, end error) {
	t.Helper()
	src := &chunkReader{data: bytes.Clone(data), size: size, err: end}
	resp := &http.Response{StatusCode: 400, Body: src, ContentLength: length}
	prefix := peekBody(resp, n, time.Minute)
	want := data[:min(n, len(data))]
	if length >= 0 && length < int64(len(want)) {
		want = data[:length]
	}
	if !bytes.Equal(prefix, want) {
		t.Fatalf("peek(%d) of %d bytes (reads of %d, length %d) = %q, want %q", n, len(data), size, length, prefix, want)
	}
	got, err := io.ReadAll(resp.Body)
	if end == nil || end == io.EOF {
		require.NoError(t, err)
	} else {
		require.ErrorIs(t, err, end)
	}
	if !bytes.Equal(got, data) {
		t.Fatalf("body after peek(%d) of %d bytes (reads of %d, length %d) = %q, want %q", n, len(data), size, length, got, data)
	}
	require.NoError(t, resp.Body.Close())
	assert.True(t, src.closed, "closing the body closes the original")
}

// TestPeekBody checks that reading the start of a body for the Provider
// loses no byte of it, and keeps how it ends, whatever its length, the
// size of its reads, its declared length and its end.
func TestPeekBody(t *testing.T) {
	reset := errors.New("connection reset")
	data := []byte(strings.Repeat("0123456789abcdef", 600)) // 9600 bytes
	for _, length := range []int{0, 1, 15, ProviderBodyLimit - 1, ProviderBodyLimit, ProviderBodyLimit + 1, len(data)} {
		for _, size := range []int{1, 7, 4096, 1 << 20} {
			for _, end := range []error{nil, reset} {
				for _, declared := range []int64{-1, int64(length)} {
					checkPeek(t, data[:length], size, ProviderBodyLimit, declared, end)
				}
			}
		}
	}
	t.Run("NoBody", func(t *testing.T) {
		resp := &http.Response{Body: http.NoBody}
		assert.Nil(t, peekBody(resp, ProviderBodyLimit, time.Minute))
		assert.Equal(t, http.NoBody, resp.Body)
	})
}

// FuzzPeekBody checks that a peek never loses, adds or reorders a byte of
// the body, for any body, read size, peek size and declared length.
func FuzzPeekBody(f *testing.F) {
	f.Add([]byte(`{"error":{"type":"idempotency_error"}}`), uint16(1), uint16(ProviderBodyLimit), true)
	f.Add(bytes.Repeat([]byte("x"), 3*ProviderBodyLimit), uint16(4096), uint16(ProviderBodyLimit), false)
	f.Add([]byte{}, uint16(7), uint16(0), true)
	f.Fuzz(func(t *testing.T, data []byte, size, n uint16, declared bool) {
		length := int64(-1)
		if declared {
			length = int64(len(data))
		}
		checkPeek(t, data, int(size)%8192+1, int(n)%(2*ProviderBodyLimit)+1, length, nil)
	})
}

// TestSynctestProviderBodyStall checks that a 4xx body that stalls while
// its start is read for the Provider costs the call a bounded time: the
// body is closed after the drain time (one second), the verdict is made on
// what arrived, and the caller reads what arrived, then an error that says
// the body stalled.
func TestSynctestProviderBodyStall(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		body := newStallingBody(`{"error":{"type":"card_error"}`)
		srv := newFake(func(req *http.Request) (*http.Response, error) {
			resp, _ := replyBody(400, "application/json", "x")(req)
			resp.Body, resp.ContentLength = body, -1
			return resp, nil
		})
		tr := &Transport{Base: srv, Provider: Stripe}
		start := time.Now()
		resp, err := fakePost(t, tr, context.Background())
		require.NoError(t, err)
		assert.Equal(t, time.Second, time.Since(start))
		got, err := io.ReadAll(resp.Body)
		assert.Equal(t, `{"error":{"type":"card_error"}`, string(got))
		require.ErrorContains(t, err, "stalled for more than 1s")
		resp.Body.Close()
	})
}

// TestProviderBodyOverHTTP2 checks over HTTP/2 that a returned 4xx whose
// start the Provider read keeps its whole body, and that the call's key and
// verdict hold there too.
func TestProviderBodyOverHTTP2(t *testing.T) {
	d := dialects[0] // Stripe
	a := d.refused[0]
	f := &providerFake{keyOf: d.keyOf, created: d.created, script: []fakeAnswer{*d.reuse, a}, stored: map[string]string{}}
	srv := newHTTP2Server(t, f)
	base := srv.Client().Transport.(*http.Transport)
	t.Cleanup(base.CloseIdleConnections)
	tr := &Transport{Base: base, Retry: fastPolicy, Provider: Stripe}

	_, err := postJSON(t, tr, context.Background(), srv.URL, `{}`)
	var reuse *KeyReuseError
	require.ErrorAs(t, err, &reuse)
	resp, err := postJSON(t, tr, context.Background(), srv.URL, `{}`)
	require.NoError(t, err)
	assert.Equal(t, 2, resp.ProtoMajor)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, a.body, string(body))
}

// BenchmarkTransportProvider is BenchmarkTransport with the Stripe
// Provider: a first-try success must cost it nothing more.
func BenchmarkTransportProvider(b *testing.B) {
	benchRoundTrip(b, &Transport{Base: roundTripFunc(benchBase), Provider: Stripe})
}
