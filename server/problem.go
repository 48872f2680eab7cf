package server

import (
	"net/http"

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

// problemTitles holds the fixed title of each of the server's own types.
var problemTitles = map[string]string{
	ProblemNotFound:             "Not found",
	ProblemMethodNotAllowed:     "Method not allowed",
	ProblemProcessorUnavailable: "Card processor unavailable",
	ProblemProcessorConflict:    "Card processor holds a different charge",
}

// writeProblem writes a problem of type typ, of this package or of package
// idempotency, with its standard title.
func writeProblem(w http.ResponseWriter, r *http.Request, typ string, status int, detail string) {
	p := idempotency.NewProblem(typ, status, detail)
	if title, ok := problemTitles[typ]; ok {
		p.Title = title
	}
	idempotency.WriteProblem(w, r, p)
}
