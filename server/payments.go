package server

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"mime"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/google/uuid"

	"github.com/idemkit/idem/server/idempotency"
)

// payments is the reference payments API:
//
//	POST /v1/payments       create a payment (behind [idempotency.Middleware])
//	GET  /v1/payments/{id}  read one of the client's payments
type payments struct {
	store     PaymentStore
	processor *processorClient
	log       *slog.Logger
	// processorTimeout bounds the processor call, which runs detached from
	// the client's cancellation.
	processorTimeout time.Duration
	// afterCharge is [Config.AfterCharge]; crashes is the key store that
	// simulates its crashes.
	afterCharge func(context.Context) error
	crashes     *crashingStore
	// storeServerErrors is [Config.StoreServerErrors]: what a 5xx tells
	// the client about retrying depends on it.
	storeServerErrors bool
	faults            Faults
}

// paymentResource is the JSON form of a payment.
type paymentResource struct {
	ID       string    `json:"id"`
	Object   string    `json:"object"`
	Amount   int64     `json:"amount"`
	Currency string    `json:"currency"`
	Customer string    `json:"customer"`
	Charge   string    `json:"charge"`
	Created  time.Time `json:"created"`
}

func resource(p Payment) paymentResource {
	return paymentResource{p.ID, "payment", p.Amount, p.Currency, p.Customer, p.ChargeID, p.CreatedAt.UTC()}
}

// paymentInput is a validated payment request.
type paymentInput struct {
	Amount   int64
	Currency string
	Customer string
}

var currencyRE = regexp.MustCompile(`^[a-z]{3}$`)

// maxCustomerLen is the longest customer id accepted, in bytes.
const maxCustomerLen = 255

// textProblem says what is wrong with s as text the API stores, or returns
// "" if nothing is. Stored text is valid UTF-8 without control characters
// (C0, DEL and C1: U+0000 to U+001F, U+007F to U+009F). PostgreSQL itself
// refuses only invalid UTF-8 and NUL, and it refuses them at the insert,
// after the card was charged; the other control characters are refused
// too because no id the API stores holds them and they make logs and
// client displays ambiguous (a newline in a customer id forges a log line).
func textProblem(s string) string {
	if !utf8.ValidString(s) {
		return "must be valid UTF-8"
	}
	for _, r := range s {
		if unicode.IsControl(r) {
			return fmt.Sprintf("must not hold control characters (U+0000 to U+001F, U+007F to U+009F); found %U", r)
		}
	}
	return ""
}

// derive returns a value derived from the client and the claim's operation:
// hex SHA-256 of purpose, client id and operation id, NUL-separated.
func derive(purpose, clientID, operationID string, n int) string {
	sum := sha256.Sum256([]byte(purpose + "\x00" + clientID + "\x00" + operationID))
	return hex.EncodeToString(sum[:])[:n]
}

// chargeKey is the idempotency key of the processor charge of an operation.
//
// It is derived from the client and [Claim.OperationID], not from the
// client's Idempotency-Key: the operation ID is kept when a stale request is
// taken over, and when a request that failed (and released its key) is
// retried, so the retry finds the charge the crashed or failed request made
// instead of making a second; and it is new when the client's key has
// expired and is used again, or is used for another request after a
// release, which is a new operation that must be charged anew (a key
// derived from the client's key would silently reuse the old charge).
// Hashing keeps the result within the processor's key rules whatever the
// client id holds, and does not tell the processor the client's key.
func chargeKey(clientID, operationID string) string {
	return "idem_ch_" + derive("charge", clientID, operationID, 40)
}

// paymentID is the id of the payment of an operation; a takeover or a retry
// after a release gets the same one.
func paymentID(clientID, operationID string) string {
	return "pay_" + derive("payment", clientID, operationID, 24)
}

func (a *payments) create(w http.ResponseWriter, r *http.Request) {
	clientID, _ := idempotency.ClientIDFromContext(r.Context())
	claim, ok := idempotency.ClaimFromContext(r.Context())
	if !ok {
		a.log.Error("payments: POST /v1/payments served without the idempotency middleware")
		writeProblem(w, r, idempotency.ProblemInternal, http.StatusInternalServerError, "The server is misconfigured.")
		return
	}
	// Step 4 of the design asks a request that takes over a stale key to
	// check whether the work already happened. Here that check is built in:
	// the payment commits only together with the key's completion, so a
	// started or released key has no payment; and the charge, the one thing
	// that may have happened, is asked for again under the same downstream
	// key, which the processor answers with the existing charge. The same
	// holds for a retry after a failure: every failure below releases the
	// key with its operation (see idempotency.Store.Release), so the retry
	// runs at once and is charged at most once.
	a.pay(w, r, order{
		clientID:  clientID,
		key:       claim.Key,
		operation: claim.OperationID,
		log:       a.log.With("client", clientID, "key", claim.Key, "operation", claim.OperationID),
	})
}

// createUnkeyed serves POST /v1/payments without the idempotency layer
// ([Config.NoIdempotency]): every request is a new operation, under a
// random ID. It does the same work as create otherwise (the same charge,
// the same insert in a transaction of its own), so that the two can be
// compared.
func (a *payments) createUnkeyed(w http.ResponseWriter, r *http.Request) {
	clientID, _ := idempotency.ClientIDFromContext(r.Context())
	operation := uuid.NewString()
	a.pay(w, r, order{
		clientID:  clientID,
		operation: operation,
		log:       a.log.With("client", clientID, "operation", operation),
	})
}

// order is one payment request as pay sees it, keyed or not.
type order struct {
	clientID  string
	key       string // the Idempotency-Key; "" without the idempotency layer
	operation string // the operation ID the charge key and payment ID derive from
	log       *slog.Logger
}

// retryHint tells the client of a failed order what a retry does, for the
// problem details of a 5xx: without keys a retry is a new payment; with
// stored server errors the retry gets this answer again; otherwise the
// same request with the same key runs again, and is charged at most once.
func (a *payments) retryHint(o order) string {
	switch {
	case o.key == "":
		return "This server runs without idempotency keys: a retry is a new payment"
	case a.storeServerErrors:
		return "This answer is stored with the Idempotency-Key and every retry with it gets it again; a new attempt needs a new key"
	}
	return "Retry exactly the same request with the same Idempotency-Key: it runs again under the same operation, and is charged at most once"
}

// validate refuses, before its key is claimed, a payment whose body is
// malformed (idempotency.Options.Validate): the key stays unused, for the
// corrected request.
func (a *payments) validate(w http.ResponseWriter, r *http.Request) bool {
	if _, status, errs := parsePayment(r); errs != nil {
		writeProblemFields(w, r, idempotency.ProblemInvalidRequest, status,
			"Fix the listed fields and retry; the same Idempotency-Key may be reused, since nothing was stored.", errs)
		return false
	}
	return true
}

// pay validates the body, charges the processor under the order's
// operation and stores the payment.
func (a *payments) pay(w http.ResponseWriter, r *http.Request, o order) {
	in, status, errs := parsePayment(r)
	if errs != nil {
		detail := "Fix the listed fields and retry; the same Idempotency-Key may be reused, since nothing was stored."
		if o.key == "" {
			detail = "Fix the listed fields and retry; nothing was stored."
		}
		writeProblemFields(w, r, idempotency.ProblemInvalidRequest, status, detail, errs)
		return
	}
	log := o.log

	// The money movement is not abandoned when the client hangs up: once
	// begun, it runs to its end and is stored, so the retry gets the replay.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), a.processorTimeout)
	defer cancel()
	charge, err := a.processor.charge(ctx, chargeKey(o.clientID, o.operation), in.Amount, in.Currency, in.Customer)
	switch {
	case err == nil:
	case errors.Is(err, errProcessorDeclined):
		log.Warn("payments: processor refused the charge", "err", err)
		writeProblem(w, r, ProblemProcessorUnavailable, http.StatusBadGateway,
			"The card processor is unavailable; nothing was charged. "+a.retryHint(o)+".")
		return
	case errors.Is(err, errProcessorConflict):
		log.Error("payments: processor holds another charge for this operation")
		writeProblem(w, r, ProblemProcessorConflict, http.StatusConflict,
			"The card processor already holds a charge for this operation with another amount or currency. Use a new Idempotency-Key.")
		return
	default:
		// The charge may or may not have happened. The 502 releases the
		// key with its operation, so the client's retry asks again under
		// the same downstream key and gets the charge if there was one.
		log.Error("payments: charge outcome unknown", "err", err)
		writeProblem(w, r, ProblemProcessorUnavailable, http.StatusBadGateway,
			"The card processor did not answer; the charge may have been made. "+a.retryHint(o)+".")
		return
	}
	if a.afterCharge != nil {
		if err := a.afterCharge(ctx); err != nil {
			log.Warn("payments: injected crash after the charge", "charge", charge.ID, "err", err)
			a.crashes.crash(r.Context())
			panic(http.ErrAbortHandler)
		}
	}
	if errors.Is(context.Cause(r.Context()), idempotency.ErrLeaseLost) {
		// A retry took the key over while this request was cut off from
		// the store: the retry records the payment (the charge it finds is
		// this one), and anything written here would be rolled back.
		log.Warn("payments: the key was taken over while this request ran; stopping before the payment", "charge", charge.ID)
		w.Header().Set("Retry-After", "1")
		writeProblem(w, r, idempotency.ProblemKeyInUse, http.StatusConflict,
			"A retry with this Idempotency-Key took this request over. Retry the same request with the same key to get the outcome.")
		return
	}
	p := Payment{
		ID:             paymentID(o.clientID, o.operation),
		ClientID:       o.clientID,
		Customer:       in.Customer,
		Amount:         in.Amount,
		Currency:       in.Currency,
		IdempotencyKey: o.key,
		OperationID:    o.operation,
		ChargeID:       charge.ID,
		CreatedAt:      time.Now().UTC().Truncate(time.Microsecond),
	}
	// Inside the key's unit of work: it commits with the stored outcome.
	if err := a.store.CreatePayment(ctx, p); err != nil {
		if errors.Is(err, ErrDuplicatePayment) && o.key != "" {
			// The payment of this operation is already stored: its key's
			// row was lost (a failover, a restore, a purge) and this is
			// the operation run again under the same derived operation
			// ID, or a retry took the key over while this request ran
			// and committed first (this request's completion is fenced
			// then). Either way the operation's answer is that payment.
			if stored, err := a.store.GetPayment(ctx, o.clientID, p.ID); err == nil && stored.OperationID == o.operation {
				log.Warn("payments: the operation's payment is stored already; answering with it", "payment", stored.ID)
				w.Header().Set("Location", "/v1/payments/"+stored.ID)
				writeJSON(w, http.StatusCreated, resource(stored))
				return
			}
			log.Warn("payments: the operation's payment was stored by a retry that took the key over")
			w.Header().Set("Retry-After", "1")
			writeProblem(w, r, idempotency.ProblemKeyInUse, http.StatusConflict,
				"A retry with this Idempotency-Key took this request over and stored its payment. Retry the same request with the same key to get the outcome.")
			return
		}
		log.Error("payments: storing the payment failed", "err", err)
		writeProblem(w, r, idempotency.ProblemInternal, http.StatusInternalServerError,
			"The payment could not be stored. "+a.retryHint(o)+".")
		return
	}
	if o.key != "" && a.faults.afterWrite(log) {
		log.Warn("payments: injected failure after the payment was written (Faults.FailAfterWriteRate)", "charge", charge.ID)
		writeProblem(w, r, idempotency.ProblemInternal, http.StatusInternalServerError,
			"Injected failure after the payment was written; nothing of it was committed. "+a.retryHint(o)+".")
		return
	}
	w.Header().Set("Location", "/v1/payments/"+p.ID)
	writeJSON(w, http.StatusCreated, resource(p))
}

// isPaymentID reports whether id has the shape of the ids paymentID makes:
// "pay_" and 24 lowercase hex digits.
func isPaymentID(id string) bool {
	hexDigits, ok := strings.CutPrefix(id, "pay_")
	if !ok || len(hexDigits) != 24 {
		return false
	}
	for i := 0; i < len(hexDigits); i++ {
		if c := hexDigits[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

func (a *payments) get(w http.ResponseWriter, r *http.Request) {
	clientID, _ := idempotency.ClientIDFromContext(r.Context())
	id := r.PathValue("id")
	var p Payment
	err := ErrNotFound
	// An id of another shape names no payment, and the store is not asked
	// about it: PostgreSQL would fail on NUL or invalid UTF-8 (a 500 where
	// the memory store says 404).
	if isPaymentID(id) {
		p, err = a.store.GetPayment(r.Context(), clientID, id)
	}
	switch {
	case errors.Is(err, ErrNotFound):
		writeProblem(w, r, ProblemNotFound, http.StatusNotFound, "No payment with this id belongs to your account. Check the id in the Location of the payment you created.")
	case err != nil:
		a.log.Error("payments: reading a payment failed", "client", clientID, "err", err)
		writeProblem(w, r, idempotency.ProblemInternal, http.StatusInternalServerError, "The payment could not be read. Retry later.")
	default:
		writeJSON(w, http.StatusOK, resource(p))
	}
}

// writeJSON writes v as a JSON response.
func writeJSON(w http.ResponseWriter, status int, v any) {
	body := encodeJSON(v)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	w.Write(body)
}

// encodeJSON returns the JSON body of v as the API writes it.
func encodeJSON(v any) []byte {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		panic(err) // the API's types always encode
	}
	return buf.Bytes()
}

// parsePayment reads and validates a payment body, JSON or form-encoded.
// It returns the status and the field errors of an invalid one.
func parsePayment(r *http.Request) (paymentInput, int, []fieldError) {
	var buf bytes.Buffer
	if _, err := buf.ReadFrom(r.Body); err != nil {
		return paymentInput{}, http.StatusBadRequest, []fieldError{{Field: "body", Detail: "could not be read"}}
	}
	mt := "application/json"
	if ct := r.Header.Get("Content-Type"); ct != "" {
		var err error
		if mt, _, err = mime.ParseMediaType(ct); err != nil {
			mt = ct
		}
	}
	var fields map[string]string
	var errs []fieldError
	switch mt {
	case "application/json":
		fields, errs = jsonFields(buf.Bytes())
	case "application/x-www-form-urlencoded":
		fields, errs = formFields(buf.String())
	default:
		return paymentInput{}, http.StatusUnsupportedMediaType,
			[]fieldError{{Field: "Content-Type", Detail: fmt.Sprintf("%q is not supported: send application/json or application/x-www-form-urlencoded", mt)}}
	}
	if errs != nil {
		return paymentInput{}, http.StatusBadRequest, errs
	}
	var in paymentInput
	amount, ok := fields["amount"]
	switch n, err := strconv.ParseInt(amount, 10, 64); {
	case !ok:
		errs = append(errs, fieldError{Field: "amount", Detail: "is required: a positive integer in the currency's smallest unit (4200 is 42.00 usd)"})
	case err != nil || n <= 0:
		errs = append(errs, fieldError{Field: "amount", Detail: "must be a positive integer in the currency's smallest unit (4200 is 42.00 usd)"})
	default:
		in.Amount = n
	}
	if in.Currency = fields["currency"]; !currencyRE.MatchString(in.Currency) {
		errs = append(errs, fieldError{Field: "currency", Detail: "must be a three-letter ISO 4217 code in lowercase, such as usd"})
	}
	// Every text field pay writes is checked here, before anything is
	// charged: the currency by its pattern, the customer below.
	switch in.Customer = fields["customer"]; {
	case in.Customer == "" || len(in.Customer) > maxCustomerLen:
		errs = append(errs, fieldError{Field: "customer", Detail: fmt.Sprintf("is required: the customer's id, such as cus_123 (at most %d bytes)", maxCustomerLen)})
	case textProblem(in.Customer) != "":
		errs = append(errs, fieldError{Field: "customer", Detail: textProblem(in.Customer) + ": the customer's id, such as cus_123"})
	}
	for name := range fields {
		if name != "amount" && name != "currency" && name != "customer" {
			errs = append(errs, fieldError{Field: name, Detail: "is not a payment field (amount, currency, customer)"})
		}
	}
	if errs != nil {
		slices.SortFunc(errs, func(a, b fieldError) int { return strings.Compare(a.Field, b.Field) })
		return paymentInput{}, http.StatusBadRequest, errs
	}
	return in, 0, nil
}

// jsonFields flattens a JSON payment object to strings: numbers as written,
// strings as they are. Other types are errors.
func jsonFields(body []byte) (map[string]string, []fieldError) {
	var raw map[string]json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	if err := dec.Decode(&raw); err != nil || raw == nil {
		return nil, []fieldError{{Field: "body", Detail: "must be a JSON object such as {\"amount\": 4200, \"currency\": \"usd\", \"customer\": \"cus_123\"}"}}
	}
	fields := make(map[string]string, len(raw))
	var errs []fieldError
	for name, v := range raw {
		var s string
		var n json.Number
		switch {
		case name == "amount" && len(v) > 0 && v[0] != '"' && json.Unmarshal(v, &n) == nil:
			fields[name] = n.String()
		case name != "amount" && !validJSONText(v):
			// encoding/json would replace these with U+FFFD: the
			// stored text would not be what the client sent.
			errs = append(errs, fieldError{Field: name, Detail: "must be valid UTF-8, without unpaired surrogate escapes such as \\ud800"})
		case name != "amount" && json.Unmarshal(v, &s) == nil:
			fields[name] = s
		case name == "amount":
			errs = append(errs, fieldError{Field: name, Detail: "must be a JSON number: a positive integer"})
		default:
			errs = append(errs, fieldError{Field: name, Detail: "must be a JSON string"})
		}
	}
	return fields, errs
}

// validJSONText reports whether the JSON value v, a string or not, is
// valid UTF-8 and escapes no unpaired UTF-16 surrogate (\ud800 alone):
// whether encoding/json decodes it without replacing anything by U+FFFD.
func validJSONText(v []byte) bool {
	if !utf8.Valid(v) {
		return false
	}
	surrogate := func(i int) rune { // the \uXXXX escape at v[i:], if any
		if i+6 > len(v) || v[i] != '\\' || v[i+1] != 'u' {
			return -1
		}
		n, err := strconv.ParseUint(string(v[i+2:i+6]), 16, 16)
		if err != nil {
			return -1
		}
		return rune(n)
	}
	for i := 0; i < len(v); i++ {
		if v[i] != '\\' {
			continue
		}
		switch r := surrogate(i); {
		case r >= 0xd800 && r < 0xdc00: // high: a low one must follow
			if lo := surrogate(i + 6); lo < 0xdc00 || lo > 0xdfff {
				return false
			}
			i += 11
		case r >= 0xdc00 && r <= 0xdfff: // low, alone
			return false
		default:
			i++ // skip the escaped character
		}
	}
	return true
}

// formFields reads a form-encoded payment; each field may appear once.
func formFields(body string) (map[string]string, []fieldError) {
	values, err := url.ParseQuery(body)
	if err != nil {
		return nil, []fieldError{{Field: "body", Detail: "is not valid application/x-www-form-urlencoded"}}
	}
	fields := make(map[string]string, len(values))
	var errs []fieldError
	for name, vs := range values {
		if len(vs) != 1 {
			errs = append(errs, fieldError{Field: name, Detail: "must be given once"})
			continue
		}
		fields[name] = vs[0]
	}
	return fields, errs
}
