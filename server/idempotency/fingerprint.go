package idempotency

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"mime"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"unicode/utf16"
	"unicode/utf8"
)

// maxJSONDepth bounds the nesting of a JSON body the canonicaliser accepts.
const maxJSONDepth = 1000

// errBody is returned (wrapped) by [Fingerprint] for a body that is not
// well-formed for its media type (see [Fingerprint] for what it rejects).
// The middleware answers it with 400 invalid-request before it claims the
// key, so nothing is stored.
var errBody = errors.New("idempotency: malformed request body")

// fingerprintTag opens the digest's input. It is the tag of the first
// canonical form, which compared a repeated query or form field's values
// as a multiset: the form differs from it only there, so every other
// request kept the fingerprint, and the operation ID, it had.
const fingerprintTag = "idem-fingerprint-v1"

// Fingerprint returns the SHA-256 fingerprint of a request: its method, its
// path, its query and its body in canonical form. contentType is the
// request's Content-Type header; it chooses how the body is canonicalised.
// There is one canonical form, so every replica of a service computes the
// same fingerprint for a request, and derives the same operation ID from
// it ([ClaimRequest.OperationID]) even when the key's row is lost.
//
// The canonical form. The body is canonicalised by media type:
//
//   - application/json, any */*+json type, or no Content-Type at all (the
//     reference API's default): the body must be exactly one UTF-8 JSON value.
//     Object members are sorted by key (byte order of the UTF-8 key), all
//     insignificant whitespace is dropped, strings are re-encoded the way
//     encoding/json writes them without HTML escaping, and numbers are kept
//     exactly as written (1.0, 1 and 1e0 are three different documents; no
//     float rounding ever merges two amounts). A body with an object that
//     repeats a key is rejected rather than guessed at (parsers disagree on
//     which duplicate wins), as is invalid UTF-8, trailing data and nesting
//     deeper than 1000 levels.
//   - application/x-www-form-urlencoded: the body is parsed as by
//     [url.ParseQuery] (a malformed escape is rejected) and the name=value
//     pairs are sorted by name, the values of a repeated name kept in
//     their order, and re-encoded with [url.QueryEscape] joined by '&'.
//     So b=2&a=1 equals a=1&b=2, but a=1&a=2 and a=2&a=1 differ, as a
//     handler's url.Values.Get tells them apart.
//   - any other media type: the body bytes as they are.
//   - an empty body, whatever its type: empty.
//
// The query string is canonicalised like a form body; an empty query is
// empty. The digest is SHA-256 over the tag "idem-fingerprint-v1" followed
// by five fields, each written as its length (8 bytes, big-endian) and its
// bytes: the method, the path, the canonical query, the body kind ("json",
// "form", "raw" or "" for an empty body) and the canonical body. Because
// the kind is hashed, the same payment sent once as JSON and once as a form
// has two different fingerprints: a client retries with the bytes it sent
// first, and two representations are two requests.
//
// Fingerprint returns an error for a body (or query) it
// cannot canonicalise. It is safe for concurrent use.
func Fingerprint(method, path, rawQuery, contentType string, body []byte) ([]byte, error) {
	query, err := canonicalForm(rawQuery)
	if err != nil {
		return nil, fmt.Errorf("%w: query: %v", errBody, err)
	}
	// The digest's input is streamed into a pooled SHA-256: the tag and the
	// first four fields, assembled in a pooled buffer, then the canonical
	// body, which is the body itself (never copied) for a raw one.
	c := getCanonicaliser()
	defer putCanonicaliser(c)
	kind := bodyKind(contentType, body)
	canon := body
	switch kind {
	case "json":
		c.out, err = c.appendJSON(c.out[:0], body)
		if err != nil {
			return nil, fmt.Errorf("%w: JSON: %v", errBody, err)
		}
		canon = c.out
	case "form":
		form, err := canonicalForm(string(body))
		if err != nil {
			return nil, fmt.Errorf("%w: form: %v", errBody, err)
		}
		canon = []byte(form)
	}
	in := append(c.in[:0], fingerprintTag...)
	in = appendField(in, method)
	in = appendField(in, path)
	in = appendField(in, query)
	in = appendField(in, kind)
	in = binary.BigEndian.AppendUint64(in, uint64(len(canon)))
	c.in = in
	h := c.sha256()
	h.Write(in)
	h.Write(canon)
	return h.Sum(nil), nil
}

// BodyFormat says how [Middleware] reads the request bodies it
// fingerprints: by their declared Content-Type (the zero value), or all as
// JSON, for a JSON API. See [Options.BodyFormat].
type BodyFormat int

// Body formats of [Options.BodyFormat].
const (
	// BodyByContentType, the default, canonicalises a body by its
	// Content-Type as [Fingerprint] describes: JSON (or no Content-Type),
	// a form, or other bytes as they are. Right for an API that accepts
	// forms as well as JSON, as the reference server does. A JSON API's
	// clients must then declare their JSON: curl -d sends
	// application/x-www-form-urlencoded, so `curl -d '{"item":"100% wool"}'`
	// is read as a form (400: a malformed escape), and two orders of the
	// same members are two requests (422).
	BodyByContentType BodyFormat = iota

	// BodyAsJSON fingerprints every body as JSON, whatever its
	// Content-Type: the same document is the same request under any
	// declared type. A body that is not one JSON document (a form, NUL
	// or invalid UTF-8) gets 400 [ProblemInvalidRequest] before the
	// claim. For a JSON API that reads its bodies as JSON whatever they
	// declare, as encoding/json handlers usually do.
	BodyAsJSON

	// BodyJSONOnly refuses a request whose Content-Type is not JSON
	// (application/json, or any */*+json type; no Content-Type at all
	// counts as JSON) with 415 [ProblemUnsupportedMediaType] and an
	// Accept-Post (or Accept-Patch) header naming application/json, before
	// its body is read, so a client learns at once to send JSON. For a
	// JSON API that wants clients to declare what they send.
	BodyJSONOnly
)

// knownBodyFormat reports whether [Middleware] knows f.
func knownBodyFormat(f BodyFormat) bool { return f >= BodyByContentType && f <= BodyJSONOnly }

// contentType returns the Content-Type a request body declared as
// declared is fingerprinted as under f, or false if f refuses it.
func (f BodyFormat) contentType(declared string) (string, bool) {
	switch f {
	case BodyAsJSON:
		return "application/json", true
	case BodyJSONOnly:
		return declared, mediaKind(declared) == "json"
	}
	return declared, true
}

// refuseMediaType answers 415 to a request whose Content-Type
// [BodyJSONOnly] refuses, before its body is read.
func refuseMediaType(w http.ResponseWriter, r *http.Request) {
	refuseUnread(w, r)
	w.Header().Set("Accept-"+strings.ToUpper(r.Method[:1])+strings.ToLower(r.Method[1:]), "application/json")
	writeProblem(w, r, ProblemUnsupportedMediaType, http.StatusUnsupportedMediaType, fmt.Sprintf(
		"This API reads JSON bodies only, and the Content-Type %q is not JSON. Send the body as JSON with Content-Type: application/json (curl -d sends a form: add -H 'Content-Type: application/json'); the key was not used.",
		r.Header.Get("Content-Type")))
}

// appendField appends s to dst as its length (8 bytes, big-endian) and its
// bytes.
func appendField(dst []byte, s string) []byte {
	dst = binary.BigEndian.AppendUint64(dst, uint64(len(s)))
	return append(dst, s...)
}

// canonicalBody returns the canonical form of a body of the given
// Content-Type and the kind of canonicalisation applied ("json", "form",
// "raw", or "" for an empty body), as described on [Fingerprint]. It is
// exported so that a developer can see exactly what is compared; the
// returned bytes are not an API format.
func canonicalBody(contentType string, body []byte) (kind string, canon []byte, err error) {
	switch kind := bodyKind(contentType, body); kind {
	case "":
		return "", nil, nil
	case "json":
		c := getCanonicaliser()
		defer putCanonicaliser(c)
		out, err := c.appendJSON(c.out[:0], body)
		c.out = out
		if err != nil {
			return "", nil, fmt.Errorf("%w: JSON: %v", errBody, err)
		}
		return "json", bytes.Clone(out), nil
	case "form":
		canon, err := canonicalForm(string(body))
		if err != nil {
			return "", nil, fmt.Errorf("%w: form: %v", errBody, err)
		}
		return "form", []byte(canon), nil
	default:
		return "raw", body, nil
	}
}

// bodyKind returns the kind of canonicalisation a body of the given
// Content-Type gets: "json", "form", "raw", or "" for an empty body.
func bodyKind(contentType string, body []byte) string {
	if len(body) == 0 {
		return ""
	}
	return mediaKind(contentType)
}

// mediaKind classifies a Content-Type header value.
func mediaKind(contentType string) string {
	// The commonest exact values first: mime.ParseMediaType allocates.
	switch contentType {
	case "application/json", "application/json; charset=utf-8":
		return "json"
	case "application/x-www-form-urlencoded":
		return "form"
	}
	if strings.TrimSpace(contentType) == "" {
		return "json"
	}
	mt, _, err := mime.ParseMediaType(contentType)
	if err != nil {
		return "raw"
	}
	switch {
	case mt == "application/json" || strings.HasSuffix(mt, "+json"):
		return "json"
	case mt == "application/x-www-form-urlencoded":
		return "form"
	}
	return "raw"
}

// canonicalForm sorts the pairs of a form-encoded string by name, keeping
// the values of a name in their order.
func canonicalForm(s string) (string, error) {
	if s == "" {
		return "", nil
	}
	values, err := url.ParseQuery(s)
	if err != nil {
		return "", err
	}
	pairs := make([][2]string, 0, len(values))
	for name, vs := range values {
		for _, v := range vs {
			pairs = append(pairs, [2]string{name, v})
		}
	}
	// url.ParseQuery keeps the values of a name in their order.
	slices.SortStableFunc(pairs, func(a, b [2]string) int { return strings.Compare(a[0], b[0]) })
	var b strings.Builder
	for i, p := range pairs {
		if i > 0 {
			b.WriteByte('&')
		}
		b.WriteString(url.QueryEscape(p[0]))
		b.WriteByte('=')
		b.WriteString(url.QueryEscape(p[1]))
	}
	return b.String(), nil
}

// A canonicaliser writes the canonical form of a JSON document
// without decoding it into Go values: a small scanner walks the bytes once,
// validating them as encoding/json's scanner does, and appends the canonical
// form of each value to an output buffer as it goes. Object members are
// written in document order, each as `"key":value`; when an object ends, its
// members are sorted by decoded key, and if they were out of order:
//
//   - if nothing within the object was out of order, its members are moved
//     into place there and then;
//   - else it is recorded (see [reordered]), and once the document has been
//     read, a second pass writes the whole of it again with the members of
//     every recorded object in order.
//
// So no byte is moved into place twice: moving an object at every level it
// is nested in would copy a document of n nested objects out of order n
// times. The work is linear in the document's size whatever its depth, and
// a document with no object out of order within another, the common case,
// needs no second pass. The scanner must accept, reject and write exactly
// what the earlier encoding/json implementation did (the canonical form is
// stored with keys); the tests fuzz it against a copy of that
// implementation.
//
// Canonicalisers are pooled, so that a fingerprint allocates next to
// nothing. A canonicaliser is used by one goroutine at a time.
type canonicaliser struct {
	// out is the canonical form being written.
	out []byte
	// in is the start of Fingerprint's digest input: the tag and the
	// fields before the body.
	in []byte
	// h is Fingerprint's SHA-256, created on first use.
	h hash.Hash
	// src is the JSON document being read, and pos the offset of the next
	// byte to read.
	src []byte
	pos int
	// members is a stack of the members of the objects being read: an
	// object pushes its members above those of the objects enclosing it
	// and pops them when it ends.
	members []member
	// keys holds the decoded form of the keys that contained escapes (a key
	// without one is its own bytes in src), and briefly that of string
	// values with escapes.
	keys []byte
	// objects lists, in document order of their '{', the objects being
	// read and the objects read that the second pass writes again (see
	// [reordered]); spans holds the members, in key order, of those out of
	// order.
	objects []reordered
	spans   []span
	// unordered counts the objects read so far whose members were out of
	// order.
	unordered int
	// tmp is scratch space for moving members into place, and the copy of
	// the output that the second pass reads from.
	tmp []byte
	// work counts, for the tests, the bytes moved into place (each twice:
	// into tmp and back) and, in the second pass, the bytes copied and the
	// objects and members visited. It stays within five times the
	// document's length, whatever the document's shape.
	work int
}

// member is one member of an object being canonicalised.
type member struct {
	key        []byte // decoded key, which the members are sorted by
	start, end int    // its canonical `"key":value` in the output buffer
	first      int    // len(objects) when the member started
}

// A reordered is an object of the first pass's output that the second pass
// writes again: either one whose members are out of order and that encloses
// an object out of order, or one enclosing a reordered, which is written as
// it is apart from what it encloses. An object of neither kind is dropped
// from the list when it ends.
type reordered struct {
	open, end int // the object's bytes in the output buffer, '{' to '}'
	next      int // the index in objects after those of the object's contents
	// spans[from:to] are its members in key order; from < 0 if they
	// already were in order.
	from, to int
}

// span is a member of an object out of order, as the second pass needs it.
type span struct {
	start, end int // its canonical `"key":value` in the output buffer
	first      int // the index in objects of the first object within it
}

// maxPooledBuffer bounds the buffers a pooled canonicaliser keeps, so that
// one huge body does not pin its buffers for good.
const maxPooledBuffer = 64 << 10

var canonicaliserPool = sync.Pool{New: func() any { return new(canonicaliser) }}

func getCanonicaliser() *canonicaliser { return canonicaliserPool.Get().(*canonicaliser) }

// sha256 returns the canonicaliser's SHA-256, reset.
func (c *canonicaliser) sha256() hash.Hash {
	if c.h == nil {
		c.h = sha256.New()
	}
	c.h.Reset()
	return c.h
}

func putCanonicaliser(c *canonicaliser) {
	if cap(c.out) > maxPooledBuffer || cap(c.in) > maxPooledBuffer || cap(c.keys) > maxPooledBuffer || cap(c.tmp) > maxPooledBuffer ||
		cap(c.members) > maxPooledBuffer/32 || cap(c.objects) > maxPooledBuffer/32 || cap(c.spans) > maxPooledBuffer/32 {
		return
	}
	// Hold on to no request's bytes.
	clear(c.members[:cap(c.members)])
	c.src, c.pos = nil, 0
	canonicaliserPool.Put(c)
}

// errUnexpectedEnd reports a JSON document that ends within a value.
var errUnexpectedEnd = errors.New("unexpected end of JSON input")

// appendJSON appends the canonical form of the JSON document body to dst. On
// error the returned slice is dst with unspecified bytes appended.
func (c *canonicaliser) appendJSON(dst, body []byte) ([]byte, error) {
	if !utf8.Valid(body) {
		return dst, errors.New("invalid UTF-8")
	}
	c.src, c.pos, c.keys = body, 0, c.keys[:0]
	c.objects, c.spans, c.unordered, c.work = c.objects[:0], c.spans[:0], 0, 0
	// The canonical form is seldom longer than the document: one allocation
	// for a large body rather than a doubling at every power of two.
	dst = slices.Grow(dst, len(body))
	base := len(dst)
	dst, err := c.value(dst, 0)
	if err != nil {
		return dst, err
	}
	c.skipSpace()
	if c.pos < len(c.src) {
		return dst, errors.New("data after the top-level value")
	}
	if len(c.objects) == 0 {
		return dst, nil
	}
	// The second pass: write the document again from a copy, in order.
	// The canonical form is as long as the first pass's output.
	c.tmp = append(c.tmp[:0], dst[base:]...)
	c.work += len(c.tmp)
	end := len(dst)
	return c.reorder(dst[:base], base, base, end, 0), nil
}

// reorder appends to dst the bytes of the first pass's output from start to
// end (offsets in the output buffer; the bytes are read from c.tmp, which
// holds the output from base on), with the members of every object out of
// order within them written in key order. first is the index in c.objects
// of the first object that opens at or after start. Each byte is copied
// once and each recorded object visited once, so the pass is linear in the
// document's size; it recurses once per level of objects out of order.
func (c *canonicaliser) reorder(dst []byte, base, start, end, first int) []byte {
	for i := first; i < len(c.objects) && c.objects[i].open < end; {
		o := c.objects[i]
		c.work++
		if o.from < 0 {
			// In order itself: its bytes are copied as they are, up to the
			// next object within it, which comes next in the list.
			i++
			continue
		}
		dst = append(dst, c.tmp[start-base:o.open-base]...)
		dst = append(dst, '{')
		c.work += o.open - start + 1
		for k, m := range c.spans[o.from:o.to] {
			if k > 0 {
				dst = append(dst, ',')
				c.work++
			}
			c.work++
			dst = c.reorder(dst, base, m.start, m.end, m.first)
		}
		dst = append(dst, '}')
		c.work++
		start, i = o.end, o.next
	}
	c.work += end - start
	return append(dst, c.tmp[start-base:end-base]...)
}

// skipSpace skips JSON whitespace.
func (c *canonicaliser) skipSpace() {
	for c.pos < len(c.src) {
		switch c.src[c.pos] {
		case ' ', '\t', '\r', '\n':
			c.pos++
		default:
			return
		}
	}
}

// syntaxError reports the byte at c.pos, which is not what context needs, or
// the end of the document if there is none.
func (c *canonicaliser) syntaxError(context string) error {
	if c.pos >= len(c.src) {
		return errUnexpectedEnd
	}
	return fmt.Errorf("invalid character %q %s at offset %d", c.src[c.pos], context, c.pos)
}

// value reads the value at c.pos (after optional whitespace), nested in
// depth arrays and objects, and appends its canonical form to dst.
func (c *canonicaliser) value(dst []byte, depth int) ([]byte, error) {
	if depth > maxJSONDepth {
		return dst, fmt.Errorf("nested deeper than %d levels", maxJSONDepth)
	}
	c.skipSpace()
	if c.pos >= len(c.src) {
		return dst, errUnexpectedEnd
	}
	switch b := c.src[c.pos]; {
	case b == '{':
		return c.object(dst, depth)
	case b == '[':
		return c.array(dst, depth)
	case b == '"':
		dst, _, err := c.string(dst, false)
		return dst, err
	case b == '-' || '0' <= b && b <= '9':
		return c.number(dst)
	case b == 't':
		return c.literal(dst, "true")
	case b == 'f':
		return c.literal(dst, "false")
	case b == 'n':
		return c.literal(dst, "null")
	}
	return dst, c.syntaxError("looking for beginning of value")
}

// literal reads the literal lit (true, false or null) and appends it.
func (c *canonicaliser) literal(dst []byte, lit string) ([]byte, error) {
	for i := range len(lit) {
		if c.pos >= len(c.src) || c.src[c.pos] != lit[i] {
			return dst, c.syntaxError("in literal " + lit)
		}
		c.pos++
	}
	return append(dst, lit...), nil
}

// number reads a number and appends it exactly as written: the canonical
// form never reformats a number.
func (c *canonicaliser) number(dst []byte) ([]byte, error) {
	src, start := c.src, c.pos
	if src[c.pos] == '-' {
		c.pos++
	}
	// Integer part: 0, or a non-zero digit and more digits.
	switch {
	case c.pos < len(src) && src[c.pos] == '0':
		c.pos++
	case c.pos < len(src) && '1' <= src[c.pos] && src[c.pos] <= '9':
		c.skipDigits()
	default:
		return dst, c.syntaxError("in numeric literal")
	}
	// Fraction: '.' and at least one digit.
	if c.pos < len(src) && src[c.pos] == '.' {
		c.pos++
		if !c.skipDigits() {
			return dst, c.syntaxError("after decimal point in numeric literal")
		}
	}
	// Exponent: 'e' or 'E', an optional sign and at least one digit.
	if c.pos < len(src) && (src[c.pos] == 'e' || src[c.pos] == 'E') {
		c.pos++
		if c.pos < len(src) && (src[c.pos] == '+' || src[c.pos] == '-') {
			c.pos++
		}
		if !c.skipDigits() {
			return dst, c.syntaxError("in exponent of numeric literal")
		}
	}
	return append(dst, src[start:c.pos]...), nil
}

// skipDigits skips decimal digits and reports whether there was one.
func (c *canonicaliser) skipDigits() bool {
	start := c.pos
	for c.pos < len(c.src) && '0' <= c.src[c.pos] && c.src[c.pos] <= '9' {
		c.pos++
	}
	return c.pos > start
}

// array reads an array and appends its canonical form.
func (c *canonicaliser) array(dst []byte, depth int) ([]byte, error) {
	c.pos++ // '['
	dst = append(dst, '[')
	c.skipSpace()
	if c.pos < len(c.src) && c.src[c.pos] == ']' {
		c.pos++
		return append(dst, ']'), nil
	}
	for {
		var err error
		if dst, err = c.value(dst, depth+1); err != nil {
			return dst, err
		}
		c.skipSpace()
		if c.pos >= len(c.src) {
			return dst, errUnexpectedEnd
		}
		switch c.src[c.pos] {
		case ',':
			c.pos++
			dst = append(dst, ',')
		case ']':
			c.pos++
			return append(dst, ']'), nil
		default:
			return dst, c.syntaxError("after array element")
		}
	}
}

// object reads an object and appends its canonical form: its members sorted
// by decoded key. An object that repeats a key is rejected.
func (c *canonicaliser) object(dst []byte, depth int) ([]byte, error) {
	c.pos++ // '{'
	c.skipSpace()
	if c.pos < len(c.src) && c.src[c.pos] == '}' {
		c.pos++
		return append(dst, '{', '}'), nil
	}
	open := len(dst)
	dst = append(dst, '{')
	base := len(c.members)
	defer func() { c.members = c.members[:base] }()
	// The object's place in c.objects, kept when it ends only if the
	// second pass needs it.
	index, unordered := len(c.objects), c.unordered
	c.objects = append(c.objects, reordered{})
	for {
		c.skipSpace()
		if c.pos >= len(c.src) || c.src[c.pos] != '"' {
			return dst, c.syntaxError("looking for beginning of object key string")
		}
		start, first := len(dst), len(c.objects)
		var key []byte
		var err error
		if dst, key, err = c.string(dst, true); err != nil {
			return dst, err
		}
		c.skipSpace()
		if c.pos >= len(c.src) || c.src[c.pos] != ':' {
			return dst, c.syntaxError("after object key")
		}
		c.pos++
		dst = append(dst, ':')
		if dst, err = c.value(dst, depth+1); err != nil {
			return dst, err
		}
		c.members = append(c.members, member{key: key, start: start, end: len(dst), first: first})
		c.skipSpace()
		if c.pos >= len(c.src) {
			return dst, errUnexpectedEnd
		}
		switch c.src[c.pos] {
		case ',':
			c.pos++
			dst = append(dst, ',')
			continue
		case '}':
			c.pos++
			ms := c.members[base:]
			sorted, err := sortMembers(ms)
			if err != nil {
				return dst, err
			}
			o := &c.objects[index]
			o.from = -1
			switch {
			case !sorted && c.unordered == unordered:
				// Nothing within was moved into place (nor recorded): move
				// the members now.
				dst = c.moveMembers(dst, open, ms)
			case !sorted:
				o.from = len(c.spans)
				for _, m := range ms {
					c.spans = append(c.spans, span{start: m.start, end: m.end, first: m.first})
				}
				o.to = len(c.spans)
			}
			if !sorted {
				c.unordered++
			}
			dst = append(dst, '}')
			if o.from >= 0 || len(c.objects) > index+1 {
				o.open, o.end, o.next = open, len(dst), len(c.objects)
			} else {
				c.objects = c.objects[:index] // nothing to write again within
			}
			return dst, nil
		default:
			return dst, c.syntaxError("after object key:value pair")
		}
	}
}

// sortMembers sorts the members ms of an object by their decoded keys,
// reports whether they already were in order, and rejects a repeated key.
func sortMembers(ms []member) (sorted bool, err error) {
	byKey := func(a, b member) int { return bytes.Compare(a.key, b.key) }
	sorted = slices.IsSortedFunc(ms, byKey)
	if !sorted {
		slices.SortFunc(ms, byKey)
	}
	for i := 1; i < len(ms); i++ {
		if bytes.Equal(ms[i-1].key, ms[i].key) {
			return sorted, fmt.Errorf("duplicate key %q", ms[i].key)
		}
	}
	return sorted, nil
}

// moveMembers puts the members ms of the object whose '{' is at dst[open],
// written in document order after it and separated by commas, in the order
// of ms. The object's length does not change.
func (c *canonicaliser) moveMembers(dst []byte, open int, ms []member) []byte {
	from := open + 1
	c.tmp = append(c.tmp[:0], dst[from:]...)
	c.work += 2 * len(c.tmp)
	dst = dst[:from]
	for i, m := range ms {
		if i > 0 {
			dst = append(dst, ',')
		}
		dst = append(dst, c.tmp[m.start-from:m.end-from]...)
	}
	return dst
}

// string reads a string and appends its canonical form to dst. It also
// returns the decoded string if key is set; the slice stays valid until the
// next call of appendJSON.
//
// As encoding/json does, it rejects control characters and unknown escapes,
// and decodes a \u escape of a lone or ill-paired surrogate as U+FFFD.
func (c *canonicaliser) string(dst []byte, key bool) ([]byte, []byte, error) {
	src := c.src
	start := c.pos + 1 // after '"'
	// Fast path: a string without escapes is its own decoded form.
	i := start
	for i < len(src) && src[i] != '"' && src[i] != '\\' && src[i] >= 0x20 {
		i++
	}
	if i < len(src) && src[i] == '"' {
		c.pos = i + 1
		s := src[start:i:i]
		return appendString(dst, s), s, nil
	}
	// Decode into c.keys, from the first escape (or bad byte) on.
	k := len(c.keys)
	out := append(c.keys, src[start:i]...)
	for {
		if i >= len(src) {
			c.pos = i
			return dst, nil, errUnexpectedEnd
		}
		b := src[i]
		switch {
		case b == '"':
			c.pos = i + 1
			c.keys = out
			s := out[k:len(out):len(out)]
			dst = appendString(dst, s)
			if !key {
				c.keys = c.keys[:k] // not needed after this call
				s = nil
			}
			return dst, s, nil
		case b < 0x20:
			c.pos = i
			return dst, nil, c.syntaxError("in string literal")
		case b != '\\':
			out = append(out, b)
			i++
			continue
		}
		// An escape.
		if i+1 >= len(src) {
			c.pos = i + 1
			return dst, nil, errUnexpectedEnd
		}
		switch e := src[i+1]; e {
		case '"', '\\', '/':
			out = append(out, e)
		case 'b':
			out = append(out, '\b')
		case 'f':
			out = append(out, '\f')
		case 'n':
			out = append(out, '\n')
		case 'r':
			out = append(out, '\r')
		case 't':
			out = append(out, '\t')
		case 'u':
			r := hex4(src, i+2)
			if r < 0 {
				c.pos = i + 2
				for c.pos < len(src) && c.pos < i+6 && isHex(src[c.pos]) {
					c.pos++
				}
				return dst, nil, c.syntaxError("in \\u hexadecimal character escape")
			}
			i += 6
			if utf16.IsSurrogate(r) {
				// A high surrogate and an escaped low one make a pair;
				// any other surrogate decodes as U+FFFD, and what follows
				// it is read on its own.
				r1 := rune(-1)
				if i+1 < len(src) && src[i] == '\\' && src[i+1] == 'u' {
					r1 = hex4(src, i+2)
				}
				if d := utf16.DecodeRune(r, r1); d != utf8.RuneError {
					out = utf8.AppendRune(out, d)
					i += 6
					continue
				}
				r = utf8.RuneError
			}
			out = utf8.AppendRune(out, r)
			continue
		default:
			c.pos = i + 1
			return dst, nil, c.syntaxError("in string escape code")
		}
		i += 2
	}
}

// hex4 returns the value of the four hexadecimal digits at src[i:], or -1 if
// there are not four.
func hex4(src []byte, i int) rune {
	if i+4 > len(src) {
		return -1
	}
	var r rune
	for _, b := range src[i : i+4] {
		switch {
		case '0' <= b && b <= '9':
			b -= '0'
		case 'a' <= b && b <= 'f':
			b -= 'a' - 10
		case 'A' <= b && b <= 'F':
			b -= 'A' - 10
		default:
			return -1
		}
		r = r<<4 | rune(b)
	}
	return r
}

func isHex(b byte) bool {
	return '0' <= b && b <= '9' || 'a' <= b && b <= 'f' || 'A' <= b && b <= 'F'
}

// appendString appends s, which is valid UTF-8, as a JSON string escaped as
// encoding/json escapes it with HTML escaping off: '"', '\\' and control
// characters are escaped (\b, \f, \n, \r, \t by name, others as \u00XX), and so
// are U+2028 and U+2029; everything else is written as it is.
func appendString(dst, s []byte) []byte {
	const hex = "0123456789abcdef"
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' && c < utf8.RuneSelf {
			i++
			continue
		}
		if c >= utf8.RuneSelf {
			r, size := utf8.DecodeRune(s[i:])
			if r != '\u2028' && r != '\u2029' {
				i += size
				continue
			}
			dst = append(dst, s[start:i]...)
			dst = append(dst, `\u202`...)
			dst = append(dst, hex[r&0xf])
			i += size
			start = i
			continue
		}
		dst = append(dst, s[start:i]...)
		switch c {
		case '"', '\\':
			dst = append(dst, '\\', c)
		case '\n':
			dst = append(dst, `\n`...)
		case '\r':
			dst = append(dst, `\r`...)
		case '\t':
			dst = append(dst, `\t`...)
		case '\b':
			dst = append(dst, `\b`...)
		case '\f':
			dst = append(dst, `\f`...)
		default:
			dst = append(dst, `\u00`...)
			dst = append(dst, hex[c>>4], hex[c&0xf])
		}
		i++
		start = i
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}
