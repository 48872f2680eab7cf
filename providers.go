package idem

import (
	"cmp"
	"encoding/json"
	"net/http"
	"slices"
	"strings"
)

// The built-in providers. Each rule cites the page of the provider's
// documentation (or, where the documentation is silent, of its own SDK) it
// comes from; docs/providers.md ("How each provider answers") has the same
// table.
// A body is parsed with encoding/json into the few fields a rule needs: a
// body that is not the provider's error object, or is cut off by
// ProviderBodyLimit, matches no body rule and leaves the status and
// headers to decide.

// Stripe is the dialect of Stripe's API (v1): the key in the
// Idempotency-Key header, a key reused with other parameters answered with
// an error of type idempotency_error (status 400), a request racing the
// first one with the key answered 409 with code idempotency_key_in_use,
// and the Stripe-Should-Retry header as the server's own retry verdict.
var Stripe = Provider{
	Name: "Stripe",
	// The key header is the default, Idempotency-Key, of at most 255
	// characters: https://docs.stripe.com/api/idempotent_requests
	MaxKeyLen:    255,
	BodyStatuses: []int{http.StatusBadRequest, http.StatusNotFound, http.StatusConflict},
	Classify:     stripeVerdict,
	Message: func(body []byte) string {
		return parse[stripeError](body).Error.Message
	},
}

// stripeError is Stripe's error body: https://docs.stripe.com/api/errors
type stripeError struct {
	Error struct {
		Type    string `json:"type"`
		Code    string `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

func stripeVerdict(resp *http.Response, body []byte) Verdict {
	e := parse[stripeError](body).Error
	// "Idempotency errors occur when an Idempotency-Key is re-used on a
	// request that does not match the first request's API endpoint and
	// parameters": https://docs.stripe.com/api/errors (error types). The
	// docs give no status; Stripe's own client maps the type on 400 and
	// 404 (stripe-ruby, lib/stripe/api_requestor.rb), and so does this.
	if e.Type == "idempotency_error" {
		return VerdictKeyReuse
	}
	// "idempotency_key_in_use: The idempotency key provided is currently
	// being used in another request": https://docs.stripe.com/error-codes;
	// 409 "conflicts with another request (perhaps due to using the same
	// idempotent key)": https://docs.stripe.com/error-low-level#status-codes
	inUse := resp.StatusCode == http.StatusConflict
	// "Stripe-Should-Retry set to true indicates that a client should
	// retry the request ... set to false means that a client should not
	// retry the request because it won't have an additional effect ... not
	// set ... fall back to other properties of the response":
	// https://docs.stripe.com/error-low-level#the-stripe-should-retry-header
	switch {
	case headerIs(resp, "Stripe-Should-Retry", "true"):
		if inUse {
			return VerdictConflict // wait it out, on the conflict budget
		}
		return VerdictRetry
	case headerIs(resp, "Stripe-Should-Retry", "false"):
		return VerdictStop
	}
	if inUse && e.Code == "idempotency_key_in_use" {
		return VerdictConflict
	}
	// Any other 409 is left to the table, which waits it out too: Stripe
	// says of a request that "conflicts with another request that's
	// executing concurrently ... You can retry these requests":
	// https://docs.stripe.com/api/idempotent_requests
	return VerdictDefault
}

// Adyen is the dialect of Adyen's APIs: the key in the Idempotency-Key
// header, a duplicate sent before the first request completed answered 422
// or 409 with errorCode 704, a transient error flagged with the
// Transient-Error: true header, and 422 for a request that fails
// validation, not for key reuse.
var Adyen = Provider{
	Name: "Adyen",
	// The key header is the default, Idempotency-Key, of at most 64
	// characters: https://docs.adyen.com/development-resources/api-idempotency
	MaxKeyLen:    64,
	BodyStatuses: []int{http.StatusConflict, http.StatusUnprocessableEntity},
	Classify:     adyenVerdict,
	Message: func(body []byte) string {
		return parse[adyenError](body).Message
	},
}

// adyenError is Adyen's error body; errorCode is a string such as "704":
// https://docs.adyen.com/development-resources/error-codes
type adyenError struct {
	ErrorCode json.RawMessage `json:"errorCode"`
	Message   string          `json:"message"`
}

func adyenVerdict(resp *http.Response, body []byte) Verdict {
	e := parse[adyenError](body)
	// "If you submit a duplicate request before the first request has
	// completed, the API returns an HTTP 422 – Unprocessable Entity or
	// HTTP 409 – Conflict status with the error code 704: request already
	// processed or in progress":
	// https://docs.adyen.com/development-resources/api-idempotency
	if code := strings.Trim(string(e.ErrorCode), `"`); code == "704" {
		return VerdictConflict
	}
	// A transient error carries Transient-Error: true, and "a subsequent
	// request using the same idempotency key will be processed as if it
	// was the first request":
	// https://docs.adyen.com/development-resources/api-idempotency, and
	// the Checkout API's additionalData.requestedTestErrorResponseCode
	// (https://github.com/Adyen/adyen-go-api-library/blob/main/src/checkout/docs/AdditionalDataCommon.md,
	// generated from Adyen's OpenAPI specification).
	if headerIs(resp, "Transient-Error", "true") {
		return VerdictRetry
	}
	// 422 "Request validation error: the request is formally valid, but
	// semantically incorrect": a refused request, not a reused key:
	// https://docs.adyen.com/development-resources/response-handling
	// A 409 without 704 is no answer of Adyen's documented idempotency
	// either.
	return returned409And422(resp)
}

// PayPal is the dialect of PayPal's REST APIs: the key in the
// PayPal-Request-Id header, a key used for another request answered with
// the issue PAYPAL_REQUEST_ID_PREVIOUSLY_USED (or DUPLICATE_REQUEST_ID in
// older APIs), a request racing a previous one answered 409
// PREVIOUS_REQUEST_IN_PROGRESS, and 422 for a request that fails business
// validation, not for key reuse.
var PayPal = Provider{
	Name: "PayPal",
	// https://developer.paypal.com/api/rest/reference/idempotency/; at
	// most 108 characters in Orders v2, the strictest limit among the
	// PayPal APIs checked:
	// https://developer.paypal.com/api/orders/v2/orders-create
	KeyHeader:    "PayPal-Request-Id",
	MaxKeyLen:    108,
	BodyStatuses: []int{http.StatusBadRequest, http.StatusConflict, http.StatusUnprocessableEntity},
	Classify:     paypalVerdict,
	Message: func(body []byte) string {
		e := parse[paypalError](body)
		for _, d := range e.Details {
			if d.Description != "" {
				return d.Description
			}
		}
		return e.Message
	},
}

// paypalError is PayPal's error body, whose name or details[].issue names
// the error: https://developer.paypal.com/api/rest/responses/
type paypalError struct {
	Name    string         `json:"name"`
	Message string         `json:"message"`
	Details []paypalDetail `json:"details"`
}

type paypalDetail struct {
	Issue       string `json:"issue"`
	Description string `json:"description"`
}

// is reports whether the error is named code, as its name or an issue.
func (e *paypalError) is(code string) bool {
	return e.Name == code || slices.ContainsFunc(e.Details, func(d paypalDetail) bool { return d.Issue == code })
}

func paypalVerdict(resp *http.Response, body []byte) Verdict {
	e := parse[paypalError](body)
	// "PAYPAL_REQUEST_ID_PREVIOUSLY_USED: The PayPal-Request-ID has
	// already been used for another request":
	// https://developer.paypal.com/api/payment-tokens/v3/errors/paypal_request_id_previously_used
	// "DUPLICATE_REQUEST_ID: The value of PayPal-Request-Id header has
	// already been used":
	// https://developer.paypal.com/api/payment-experience/v1/errors/duplicate_request_id
	if e.is("PAYPAL_REQUEST_ID_PREVIOUSLY_USED") || e.is("DUPLICATE_REQUEST_ID") {
		return VerdictKeyReuse
	}
	// "PREVIOUS_REQUEST_IN_PROGRESS: A previous request on this resource
	// is currently in progress. Please wait for sometime and try again":
	// https://developer.paypal.com/api/payments/v2/errors/previous_request_in_progress
	if e.is("PREVIOUS_REQUEST_IN_PROGRESS") {
		return VerdictConflict
	}
	// 422 UNPROCESSABLE_ENTITY: "The requested action could not be
	// performed, semantically incorrect, or failed business validation":
	// https://developer.paypal.com/api/rest/troubleshooting/rest_unprocessable_entity/
	// Another 409 is no in-progress answer PayPal documents.
	return returned409And422(resp)
}

// Square is the dialect of Square's APIs: the key in the idempotency_key
// field of the JSON body, a key reused with another request answered with
// the error code IDEMPOTENCY_KEY_REUSED, and 409 and 422 as general
// errors, neither an in-progress answer nor key reuse.
var Square = Provider{
	Name: "Square",
	// https://developer.squareup.com/docs/build-basics/common-api-patterns/idempotency
	KeyBodyField: "idempotency_key",
	// 45 characters for CreatePayment, the strictest limit documented
	// (Square's SDK reference:
	// https://github.com/square/square-php-sdk/blob/master/doc/models/create-payment-request.md);
	// other endpoints may take more, and are held to it too.
	MaxKeyLen:    45,
	BodyStatuses: []int{http.StatusBadRequest, http.StatusConflict, http.StatusUnprocessableEntity},
	Classify:     squareVerdict,
	Message: func(body []byte) string {
		for _, e := range parse[squareErrors](body).Errors {
			if e.Detail != "" {
				return e.Detail
			}
		}
		return ""
	},
}

// squareErrors is Square's error body:
// https://developer.squareup.com/docs/build-basics/handling-errors
type squareErrors struct {
	Errors []struct {
		Code   string `json:"code"`
		Detail string `json:"detail"`
	} `json:"errors"`
}

func squareVerdict(resp *http.Response, body []byte) Verdict {
	for _, e := range parse[squareErrors](body).Errors {
		// "If you use the same idempotency key but change the
		// CreatePayment request ... you get an error indicating that you
		// used the idempotency key previously":
		// https://developer.squareup.com/docs/build-basics/common-api-patterns/idempotency
		// whose code is "IDEMPOTENCY_KEY_REUSED: The provided idempotency
		// key has already been used":
		// https://developer.squareup.com/reference/square/enums/ErrorCode
		if e.Code == "IDEMPOTENCY_KEY_REUSED" {
			return VerdictKeyReuse
		}
	}
	// 409 "CONFLICT: a general error occurred" and 422
	// "UNPROCESSABLE_ENTITY: a general error occurred":
	// https://developer.squareup.com/reference/square/enums/ErrorCode
	// Square documents no answer for a request still running.
	return returned409And422(resp)
}

// AWS is the dialect of AWS's JSON APIs, such as Cloud Control: the key in
// the ClientToken field of the JSON body, and the error named by the
// X-Amzn-ErrorType header or the body's __type: ClientTokenConflictException
// or IdempotentParameterMismatch(Exception) for a token used for another
// request, TransactionInProgressException for one still running, and the
// throttling and transient errors the AWS SDKs retry. AWS's XML (Query)
// APIs, such as EC2's, are not covered: their bodies are not JSON, so the
// key cannot go in a JSON field either.
var AWS = Provider{
	Name: "AWS",
	// "ClientToken: A unique identifier to ensure the idempotency of the
	// resource request ... valid for 36 hours once used":
	// https://docs.aws.amazon.com/cloudcontrolapi/latest/APIReference/API_CreateResource.html
	KeyBodyField: "ClientToken",
	// At most 128 characters for Cloud Control's ClientToken (page above).
	MaxKeyLen:    128,
	BodyStatuses: []int{http.StatusBadRequest, http.StatusConflict},
	Classify:     awsVerdict,
	Message: func(body []byte) string {
		return parse[awsError](body).Message
	},
}

// awsError is the error body of AWS's JSON protocols, whose type is in
// __type (or code), and its message in message or Message (encoding/json
// matches either): https://smithy.io/2.0/aws/protocols/aws-json-1_0-protocol.html
type awsError struct {
	Type    string `json:"__type"`
	Code    string `json:"code"`
	Message string `json:"message"`
}

// awsRetried names the errors the AWS SDKs' standard retry mode retries,
// transient and throttling ones, which AWS's JSON APIs answer with 400:
// https://boto3.amazonaws.com/v1/documentation/api/latest/guide/retries.html
var awsRetried = []string{
	"RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete",
	"Throttling", "ThrottlingException", "ThrottledException", "RequestThrottledException",
	"TooManyRequestsException", "ProvisionedThroughputExceededException",
	"RequestLimitExceeded", "BandwidthLimitExceeded", "LimitExceededException",
	"RequestThrottled", "SlowDown", "EC2ThrottledException",
}

func awsVerdict(resp *http.Response, body []byte) Verdict {
	// The error type is the X-Amzn-ErrorType header, else the body's
	// __type or code, each possibly written namespace#Name:extra:
	// https://smithy.io/2.0/aws/protocols/aws-json-1_0-protocol.html
	typ := resp.Header.Get("X-Amzn-ErrorType")
	if typ == "" {
		e := parse[awsError](body)
		typ = cmp.Or(e.Type, e.Code)
	}
	typ = awsErrorName(typ)
	switch {
	case typ == "ClientTokenConflictException":
		// "The specified client token has already been used in another
		// resource request":
		// https://docs.aws.amazon.com/cloudcontrolapi/latest/APIReference/API_CreateResource.html
		return VerdictKeyReuse
	case typ == "IdempotentParameterMismatchException", typ == "IdempotentParameterMismatch":
		// "DynamoDB rejected the request because you retried a request
		// with a different payload but with an idempotent token that was
		// already used":
		// https://docs.aws.amazon.com/amazondynamodb/latest/APIReference/API_TransactWriteItems.html
		// (EC2 names it IdempotentParameterMismatch:
		// https://docs.aws.amazon.com/ec2/latest/devguide/ec2-api-idempotency.html)
		return VerdictKeyReuse
	case typ == "TransactionInProgressException":
		// "The transaction with the given request token is already in
		// progress":
		// https://docs.aws.amazon.com/amazondynamodb/latest/APIReference/API_TransactWriteItems.html
		return VerdictConflict
	case slices.Contains(awsRetried, typ):
		return VerdictRetry
	}
	// A 409 (ConflictException in AWS's REST APIs) is a conflict with the
	// resource's state, or with a token used before; nothing AWS documents
	// as a request still running.
	return returned409And422(resp)
}

// Azure is the dialect of Azure's APIs that implement OASIS Repeatable
// Requests 1.0, such as Azure Communication Services' Email and Rooms
// APIs: the key in the Repeatability-Request-ID header (a GUID; idem's
// new keys are UUIDs), the first-sent time in Repeatability-First-Sent
// (the Transport's default FirstSentHeader: do not set NoFirstSent), and
// the service's verdict read back from the Repeatability-Result header: a
// request whose first-sent time is outside the window in which the
// service tracks requests is answered 412 with Repeatability-Result:
// rejected, which ends the call with a [*KeyExpiredError] (the outcome is
// unknown). Its other answers keep the table: a request still running is
// answered 409, and a key reused for another request 400 with
// Repeatability-Result: rejected, which is returned as it is (the same
// answer covers malformed repeatability headers).
var Azure = Provider{
	Name: "Azure",
	// "Repeatability-Request-Id ... identifies the request uniquely with a
	// GUID", "Repeatability-First-Sent ... in UTC in IMF-fixdate format",
	// and the 412 "Pre-condition failed" for a first-sent time outside
	// the tracked duration:
	// https://learn.microsoft.com/en-us/rest/api/communication/repeatable-requests
	KeyHeader: "Repeatability-Request-ID",
	Classify:  azureVerdict,
	Message: func(body []byte) string {
		return parse[azureError](body).Error.Message
	},
}

// azureError is the error body of Azure's APIs:
// https://github.com/microsoft/api-guidelines/blob/vNext/azure/Guidelines.md#handling-errors
type azureError struct {
	Error struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

func azureVerdict(resp *http.Response, _ []byte) Verdict {
	// A 412 is also the answer to a failed If-Match; only one that says
	// Repeatability-Result: rejected is about the first-sent time.
	if resp.StatusCode == http.StatusPreconditionFailed && headerIs(resp, "Repeatability-Result", "rejected") {
		return VerdictKeyExpired
	}
	return VerdictDefault
}

// returned409And422 is the last rule of the providers whose 409 and 422
// are neither a request still running nor key reuse, unless their body
// said so (the rules before it): such an answer is returned as it is, not
// waited out nor turned into a KeyReuseError as the IETF draft's table
// would. Other statuses keep the table.
func returned409And422(resp *http.Response) Verdict {
	if resp.StatusCode == http.StatusConflict || resp.StatusCode == http.StatusUnprocessableEntity {
		return VerdictStop
	}
	return VerdictDefault
}

// awsErrorName returns the bare shape name of an AWS error type written as
// namespace#Name:extra, any part but Name optional.
func awsErrorName(s string) string {
	s, _, _ = strings.Cut(s, ":")
	if i := strings.LastIndexByte(s, '#'); i >= 0 {
		s = s[i+1:]
	}
	return strings.TrimSpace(s)
}

// parse decodes body into a T, leaving it zero where the body is not the
// JSON T describes (nil, another type, cut short).
func parse[T any](body []byte) *T {
	v := new(T)
	if len(body) > 0 {
		_ = json.Unmarshal(body, v)
	}
	return v
}

// headerIs reports whether resp's header name holds value, ignoring case
// and surrounding space.
func headerIs(resp *http.Response, name, value string) bool {
	return strings.EqualFold(strings.TrimSpace(resp.Header.Get(name)), value)
}
