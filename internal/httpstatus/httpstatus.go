// Package httpstatus gives the reason phrases of RFC 9110, which idem prints
// everywhere: Go's http.StatusText still has the older phrases of RFC 7231
// and RFC 4918 for four codes ("Unprocessable Entity" for 422, say).
package httpstatus

import "net/http"

// rfc9110 are the phrases of RFC 9110 that differ from http.StatusText.
var rfc9110 = map[int]string{
	http.StatusRequestEntityTooLarge:        "Content Too Large",
	http.StatusRequestURITooLong:            "URI Too Long",
	http.StatusRequestedRangeNotSatisfiable: "Range Not Satisfiable",
	http.StatusUnprocessableEntity:          "Unprocessable Content",
}

// Text returns the RFC 9110 reason phrase of code, or "" for a code it
// does not know.
func Text(code int) string {
	if phrase, ok := rfc9110[code]; ok {
		return phrase
	}
	return http.StatusText(code)
}
