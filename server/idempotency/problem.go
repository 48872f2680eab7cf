package idempotency

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// Problem type URIs. Every error response of [Middleware] is an RFC 9457
// problem whose "type" is one of these, one per case, so clients can switch
// on it; the URIs are stable and are never reused for another case. Each
// names a page documenting the case. A handler may use them too for its own
// errors of the same kinds.
const (
	// ProblemKeyMissing (400): a POST or PATCH came without an
	// Idempotency-Key header.
	ProblemKeyMissing = "https://idemkit.dev/problems/idempotency-key-missing"
	// ProblemKeyInvalid (400): the Idempotency-Key header is sent on more than
	// one line, is empty, is longer than 255 characters, has characters
	// outside visible ASCII, or is not a valid structured-field string.
	ProblemKeyInvalid = "https://idemkit.dev/problems/idempotency-key-invalid"
	// ProblemKeyInUse (409): a request with the same key is still running,
	// or this request was taken over by a retry after the lock timeout.
	ProblemKeyInUse = "https://idemkit.dev/problems/idempotency-key-in-use"
	// ProblemKeyMismatch (422): the key was used before with a different
	// request (method, path, query or body).
	ProblemKeyMismatch = "https://idemkit.dev/problems/idempotency-key-mismatch"
	// ProblemInvalidRequest (400): the body is malformed or fails
	// validation. Nothing is stored; the key stays free.
	ProblemInvalidRequest = "https://idemkit.dev/problems/invalid-request"
	// ProblemUnauthorized (401): the request is not authenticated
	// ([Options.ClientID] found no client).
	ProblemUnauthorized = "https://idemkit.dev/problems/unauthorized"
	// ProblemTooLarge (413): the body is over the size limit.
	ProblemTooLarge = "https://idemkit.dev/problems/request-too-large"
	// ProblemUnsupportedMediaType (415): the body's Content-Type is not
	// JSON and [Options.BodyFormat] is [BodyJSONOnly]. Nothing is stored;
	// the key stays free.
	ProblemUnsupportedMediaType = "https://idemkit.dev/problems/unsupported-media-type"
	// ProblemInternal (500): an unexpected server error. Unless
	// [Options.StoreServerErrors] is set, the key is released and a retry of
	// the same request runs again.
	ProblemInternal = "https://idemkit.dev/problems/internal"
	// ProblemUnavailable (503, with Retry-After): the request was not run,
	// and nothing of it was done: its context ended first (the client's
	// deadline passed, or the server is shutting down), or the key's
	// database is read-only for now. Retry the same request with the same
	// key.
	ProblemUnavailable = "https://idemkit.dev/problems/unavailable"
	// ProblemKeyExpired (410): the request was first sent (its
	// Repeatability-First-Sent) longer ago than its key is kept, and the
	// key is gone or expired: the original outcome of the operation is
	// unknown and can no longer be looked up. Nothing was run. The client
	// must not retry with a new key blindly: the operation may have taken
	// effect; check for it by other means first.
	ProblemKeyExpired = "https://idemkit.dev/problems/idempotency-key-expired"
)

// problemTitles holds the fixed, human-readable title of each type.
var problemTitles = map[string]string{
	// Of the stored responses (seal.go, stored.go).
	ProblemResponseSealed:   "The stored response cannot be read",
	ProblemResponseTooLarge: "The response was too large to keep",

	ProblemKeyMissing:           "Idempotency-Key header is missing",
	ProblemKeyInvalid:           "Idempotency-Key header is invalid",
	ProblemKeyInUse:             "A request with this Idempotency-Key is in progress",
	ProblemKeyMismatch:          "Idempotency-Key was used with a different request",
	ProblemInvalidRequest:       "The request is invalid",
	ProblemUnauthorized:         "Authentication required",
	ProblemTooLarge:             "Request body too large",
	ProblemUnsupportedMediaType: "Unsupported media type",
	ProblemInternal:             "Internal server error",
	ProblemUnavailable:          "The request was not run",
	ProblemKeyExpired:           "Idempotency-Key has expired",
}

// problem is an RFC 9457 problem details object, as written with the media
// type application/problem+json.
type problem struct {
	Type     string `json:"type"`
	Title    string `json:"title"`
	Status   int    `json:"status"`
	Detail   string `json:"detail,omitempty"`
	Instance string `json:"instance,omitempty"` // the request path
}

// writeProblem writes a problem of type typ, with its title, the status
// and the detail, which tells the developer what to do. Headers already
// set on w (Retry-After, Idempotency-Key) are kept.
func writeProblem(w http.ResponseWriter, r *http.Request, typ string, status int, detail string) {
	body, err := json.Marshal(problem{Type: typ, Title: problemTitles[typ], Status: status, Detail: detail, Instance: r.URL.Path})
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
