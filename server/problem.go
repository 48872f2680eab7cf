package server

import (
	"encoding/json"
	"net/http"
	"strconv"

	"github.com/idemkit/idem/server/idempotency"
)

// Problem type URIs of the reference API's own errors, beside those of
// [idempotency.Middleware] (idempotency.Problem…), which it uses too. Each is
// stable and names a page documenting the case.
const (
	// ProblemNotFound (404): no such resource for this client.
	ProblemNotFound = "https://idemkit.dev/problems/not-found"
	// ProblemMethodNotAllowed (405): the resource does not support the method.
	ProblemMethodNotAllowed = "https://idemkit.dev/problems/method-not-allowed"
	// ProblemProcessorUnavailable (502): the card processor refused the
	// charge or could not be reached. The retry of the same request with
	// the same key runs under the same operation, so it is charged at most
	// once.
	ProblemProcessorUnavailable = "https://idemkit.dev/problems/processor-unavailable"
	// ProblemProcessorConflict (409): the card processor holds a charge for
	// this operation with another amount or currency.
	ProblemProcessorConflict = "https://idemkit.dev/problems/processor-conflict"
)

// problemTitles holds the fixed title of each type the server writes.
var problemTitles = map[string]string{
	ProblemNotFound:             "Not found",
	ProblemMethodNotAllowed:     "Method not allowed",
	ProblemProcessorUnavailable: "Card processor unavailable",
	ProblemProcessorConflict:    "Card processor holds a different charge",

	// Package idempotency's, as it titles them.
	idempotency.ProblemInternal:       "Internal server error",
	idempotency.ProblemInvalidRequest: "The request is invalid",
	idempotency.ProblemKeyInUse:       "A request with this Idempotency-Key is in progress",
	idempotency.ProblemKeyInvalid:     "Idempotency-Key header is invalid",
	idempotency.ProblemKeyMismatch:    "Idempotency-Key was used with a different request",
	idempotency.ProblemUnauthorized:   "Authentication required",
}

// problem is an RFC 9457 problem details object, as written with the
// media type application/problem+json.
type problem struct {
	Type     string `json:"type"`
	Title    string `json:"title"`
	Status   int    `json:"status"`
	Detail   string `json:"detail,omitempty"`
	Instance string `json:"instance,omitempty"` // the request path
	// Errors lists the invalid fields of an idempotency.ProblemInvalidRequest.
	Errors []fieldError `json:"errors,omitempty"`
}

// fieldError names one invalid field of a request body.
type fieldError struct {
	Field  string `json:"field"`
	Detail string `json:"detail"`
}

// writeProblem writes a problem of type typ, of this package or of package
// idempotency, with its standard title.
func writeProblem(w http.ResponseWriter, r *http.Request, typ string, status int, detail string) {
	writeProblemFields(w, r, typ, status, detail, nil)
}

// writeProblemFields writes a problem that lists the invalid fields.
// Headers already set on w (Retry-After, Idempotency-Key) are kept.
func writeProblemFields(w http.ResponseWriter, r *http.Request, typ string, status int, detail string, errs []fieldError) {
	title, ok := problemTitles[typ]
	if !ok {
		title = http.StatusText(status)
	}
	body, err := json.Marshal(problem{Type: typ, Title: title, Status: status, Detail: detail, Instance: r.URL.Path, Errors: errs})
	if err != nil { // a problem always marshals
		panic(err)
	}
	body = append(body, '\n')
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	h.Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	w.Write(body)
}
