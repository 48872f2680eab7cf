package idempotency

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"net/http"
	"slices"
)

// DefaultMaxStoredBodyBytes is the default of [Options.MaxStoredBodyBytes].
const DefaultMaxStoredBodyBytes = 1 << 20

// RedactedHeader is the response header of a replay whose stored response
// is not the first response: [Options.Redact] changed it, or its body was
// over [Options.MaxStoredBodyBytes] ([ProblemResponseTooLarge]). Its value
// is "true". The first response never carries it.
const RedactedHeader = "Idempotent-Replay-Redacted"

// ProblemResponseTooLarge is the type of the body a replay carries in
// place of a first response whose body was larger than
// [Options.MaxStoredBodyBytes]: the replay has the first response's status
// (a 201 stays a 201: the operation was done) and its stored headers but
// those that describe the body it replaces (Location, so the client can
// fetch the resource, but no ETag or Content-Encoding), an
// application/problem+json body of this type that says so, and
// [RedactedHeader]. The operation is not run again.
const ProblemResponseTooLarge = "https://idemkit.dev/problems/idempotency-response-too-large"

// DefaultStoredHeaders returns the response headers stored with an outcome
// and replayed with it when [Options.StoredHeaders] is nil: those a replay
// needs to mean what the first response meant (where the result is, how
// its body is encoded and may be cached, when to come back), and none that
// is about the connection or the client. A new slice each call, to extend:
//
//	StoredHeaders: append(idempotency.DefaultStoredHeaders(), "Request-Id")
func DefaultStoredHeaders() []string {
	return []string{
		"Cache-Control",
		"Content-Disposition",
		"Content-Encoding",
		"Content-Language",
		"Content-Location",
		"Etag",
		"Expires",
		"Last-Modified",
		"Link",
		"Location",
		"Retry-After",
		"Vary",
	}
}

// credentialHeaders carry credentials or set them: never stored, whatever
// Options.StoredHeaders says, since a replay would hand them to whoever
// sends the key again, and the store keeps them for the retention.
var credentialHeaders = map[string]bool{
	"Authentication-Info":       true,
	"Authorization":             true,
	"Cookie":                    true,
	"Proxy-Authenticate":        true,
	"Proxy-Authentication-Info": true,
	"Proxy-Authorization":       true,
	"Set-Cookie":                true,
	"Set-Cookie2":               true,
	"Www-Authenticate":          true,
}

// unstoredHeaders are never stored either: the framing and connection
// headers, which the server writes for each response, Content-Type, which
// is stored on its own, and the headers the middleware sets itself.
var unstoredHeaders = map[string]bool{
	"Connection":          true,
	"Content-Length":      true,
	"Content-Type":        true,
	"Date":                true,
	"Keep-Alive":          true,
	"Proxy-Connection":    true,
	"Te":                  true,
	"Trailer":             true,
	"Transfer-Encoding":   true,
	"Upgrade":             true,
	"Idempotent-Replayed": true,
	RedactedHeader:        true,
	// Canonical, as the names it is looked up with.
	http.CanonicalHeaderKey(RetentionHeader): true,
}

// representationHeaders describe a body: a replay that replaces the body
// ([ProblemResponseTooLarge]) goes without them.
var representationHeaders = map[string]bool{
	"Content-Digest":      true,
	"Content-Disposition": true,
	"Content-Encoding":    true,
	"Content-Language":    true,
	"Content-Location":    true,
	"Content-Range":       true,
	"Digest":              true,
	"Etag":                true,
	"Last-Modified":       true,
	"Repr-Digest":         true,
}

// keepPolicy is what of a handler's response the middleware stores, from
// [Options.StoredHeaders], [Options.Redact] and
// [Options.MaxStoredBodyBytes].
type keepPolicy struct {
	headers   map[string]bool // stored, canonical names
	keyHeader string
	redact    func(*http.Request, StoredResponse) StoredResponse
	maxBody   int64 // 0: no cap
}

// newKeepPolicy returns the policy of opts, and the names of the headers
// opts lists that are never stored.
func newKeepPolicy(opts Options, keyHeader string) (p keepPolicy, ignored []string) {
	names := opts.StoredHeaders
	if names == nil {
		names = DefaultStoredHeaders()
	}
	p = keepPolicy{headers: make(map[string]bool, len(names)), keyHeader: keyHeader, redact: opts.Redact}
	for _, name := range names {
		name = http.CanonicalHeaderKey(name)
		if credentialHeaders[name] || unstoredHeaders[name] || name == keyHeader {
			if name != "Content-Type" {
				ignored = append(ignored, name)
			}
			continue
		}
		p.headers[name] = true
	}
	switch {
	case opts.MaxStoredBodyBytes == 0:
		p.maxBody = DefaultMaxStoredBodyBytes
	case opts.MaxStoredBodyBytes > 0:
		p.maxBody = opts.MaxStoredBodyBytes
	}
	return p, ignored
}

// keeps reports whether the header name is stored.
func (p *keepPolicy) keeps(name string) bool { return p.headers[http.CanonicalHeaderKey(name)] }

// replays reports whether a stored header name is replayed: when p would
// store it, and [RedactedHeader], which the middleware stores itself. A
// row written otherwise (by a [SweepFunc] before its settlements were
// filtered, by an older release, by whoever can write the store) replays
// no credential, no framing header and no key header, and no header the
// service no longer keeps.
func (p *keepPolicy) replays(name string) bool {
	name = http.CanonicalHeaderKey(name)
	return p.headers[name] || name == RedactedHeader
}

// settled returns what p stores of a settlement's response (see
// [Sweeper]): its status and body, its content type when it is valid
// text, and the headers p keeps whose name and value are valid text, by
// their canonical names; and the names of the headers it leaves out.
// Unlike a handler's response, a settlement is neither redacted nor
// capped: the hook writes what is to be replayed.
func (p *keepPolicy) settled(resp StoredResponse) (out StoredResponse, dropped []string) {
	out = StoredResponse{Status: resp.Status, ContentType: resp.ContentType, Body: resp.Body}
	if !ValidText(out.ContentType) {
		out.ContentType = ""
		dropped = append(dropped, "Content-Type")
	}
	for _, name := range slices.Sorted(maps.Keys(resp.Header)) {
		value := resp.Header[name]
		if !p.keeps(name) || !ValidText(name) || !ValidText(value) {
			dropped = append(dropped, name)
			continue
		}
		if out.Header == nil {
			out.Header = make(map[string]string, len(resp.Header))
		}
		out.Header[http.CanonicalHeaderKey(name)] = value
	}
	return out, dropped
}

// storedResponse returns what is stored of the handler's response rec, by
// the policy: its status; its content type and the headers the policy
// keeps that are valid text ([ValidText]); what [Options.Redact] makes of
// that; and in place of a body over the cap, a [ProblemResponseTooLarge].
// A stored response that is not rec's says so with [RedactedHeader]. It
// returns an error when the redaction hook panicked.
func (m *middleware) storedResponse(r *http.Request, rec *recorder, log *slog.Logger) (StoredResponse, error) {
	p := &m.keep
	resp, dropped := rec.stored(p.keeps)
	if len(dropped) > 0 {
		log.Warn("idempotency: headers that are not valid text are sent but not stored: replays go without them", "headers", dropped)
	}
	redacted := false
	if p.redact != nil {
		out, err := p.redacted(r, resp)
		if err != nil {
			return StoredResponse{}, err
		}
		redacted = out.ContentType != resp.ContentType || !maps.Equal(out.Header, resp.Header) || !bytes.Equal(out.Body, resp.Body)
		resp = out
	}
	if p.maxBody > 0 && int64(len(resp.Body)) > p.maxBody {
		log.Warn("idempotency: the response body is over the stored size cap: its status and headers are stored, and replays carry a problem in place of the body",
			"bytes", len(resp.Body), "max_stored_body_bytes", p.maxBody)
		resp = m.tooLarge(r, resp)
		redacted = true
	}
	if redacted {
		if resp.Header == nil {
			resp.Header = make(map[string]string, 1)
		}
		resp.Header[RedactedHeader] = "true"
	}
	return resp, nil
}

// redacted returns what [Options.Redact] makes of resp, which it may
// change, checked again: the status is resp's, and the content type and
// headers are kept only as the policy keeps them.
func (p *keepPolicy) redacted(r *http.Request, resp StoredResponse) (out StoredResponse, err error) {
	in := resp
	in.Header = maps.Clone(resp.Header)
	if in.Header == nil {
		in.Header = make(map[string]string) // the hook may add to it
	}
	in.Body = bytes.Clone(resp.Body)
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("idempotency: Options.Redact panicked: %v", v)
		}
	}()
	out = p.redact(r, in)
	out.Status = resp.Status
	if !ValidText(out.ContentType) {
		out.ContentType = ""
	}
	var header map[string]string
	for _, name := range slices.Sorted(maps.Keys(out.Header)) {
		value := out.Header[name]
		if canon := http.CanonicalHeaderKey(name); p.keeps(canon) && ValidText(value) {
			if header == nil {
				header = make(map[string]string, len(out.Header))
			}
			header[canon] = value
		}
	}
	out.Header = header
	if len(out.Body) == 0 {
		out.Body = nil
	}
	return out, nil
}

// tooLarge returns what is stored in place of resp, whose body is over the
// cap: see [ProblemResponseTooLarge].
func (m *middleware) tooLarge(r *http.Request, resp StoredResponse) StoredResponse {
	var header map[string]string
	for name, value := range resp.Header {
		if !representationHeaders[name] {
			if header == nil {
				header = make(map[string]string, len(resp.Header))
			}
			header[name] = value
		}
	}
	detail := fmt.Sprintf(
		"The first request with this %s was answered %d %s with a body of %d bytes, more than the %d bytes kept for a replay: this replay carries its status and headers, not its body. The request was not run again; do not send it again with a new key.",
		m.keyHeader, resp.Status, http.StatusText(resp.Status), len(resp.Body), m.keep.maxBody)
	if header["Location"] != "" {
		detail += " Read the result at the URL of the Location header."
	}
	body, err := json.Marshal(problem{Type: ProblemResponseTooLarge, Title: problemTitles[ProblemResponseTooLarge],
		Status: resp.Status, Detail: detail, Instance: r.URL.Path})
	if err != nil { // a problem always marshals
		panic(err)
	}
	return StoredResponse{Status: resp.Status, ContentType: "application/problem+json", Header: header, Body: append(body, '\n')}
}

// unopened answers a replay whose stored response is still sealed (see
// [Sealed]) with 500 [ProblemResponseSealed], and reports whether it did.
func (m *middleware) unopened(w http.ResponseWriter, r *http.Request, resp *StoredResponse, log *slog.Logger) bool {
	id, sealed := sealKeyID(*resp)
	if !sealed {
		return false
	}
	log.Error("idempotency: the stored response of a completed key is sealed and cannot be opened: the key that sealed it is not among this server's seal keys (or sealing is off here), or the row was altered or copied from another key's; answered 500, the operation is not run again",
		"seal_key", id, "status", resp.Status)
	writeProblem(w, r, ProblemResponseSealed, http.StatusInternalServerError, fmt.Sprintf(
		"The request with this %s was done, and its outcome was stored sealed; this server cannot open it. The request was not run again, and will not be: retry it with the same key later, or ask the API's operator.",
		m.keyHeader))
	return true
}

// storableStatus reports whether status is a key's final outcome, stored
// and replayed, by the rules [Middleware] documents: 2xx, 3xx and the
// definitive 4xx are; the 4xx that reject a request before it did
// anything, the 5xx (unless storeServerErrors) and what is no HTTP
// status are not. A [Sweeper]'s settlements follow the same rules. A 1xx
// is no final answer either (a replay of one would be followed by
// net/http's 200): a handler's never reaches here, a settlement's may.
func storableStatus(status int, storeServerErrors bool) bool {
	switch {
	case !ValidStatus(status): // no store keeps it
		return false
	case status < 200:
		return false
	case status >= 500:
		return storeServerErrors
	case status < 400:
		return true
	}
	switch status {
	case http.StatusBadRequest, http.StatusUnauthorized, http.StatusForbidden,
		http.StatusNotFound, http.StatusMethodNotAllowed, http.StatusRequestTimeout,
		http.StatusConflict, http.StatusRequestEntityTooLarge,
		http.StatusUnsupportedMediaType, http.StatusTooEarly, http.StatusTooManyRequests:
		return false
	}
	return true
}
