package idem

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/textproto"
	"unicode/utf8"

	"github.com/idemkit/idem/internal/keyheader"
)

// ErrKeyBodyField is in the chain of the error [Transport.RoundTrip]
// returns, before anything is sent, when [Transport.KeyBodyField] is set
// and the body of a keyed request cannot carry the key: it is missing or
// empty, larger than [Transport.MaxBufferedBody], not valid JSON or not a
// JSON object, names the field more than once at its top level, or holds
// it as something other than a string. A caller writes:
//
//	if errors.Is(err, idem.ErrKeyBodyField) {
//		// a bug in the request: nothing was sent
//	}
var ErrKeyBodyField = errors.New("idem: request body cannot carry the key field")

// initBodyKey chooses the key of a keyed operation whose key goes in the
// body field t.KeyBodyField, and prepares the body every attempt sends.
// The body is read once (up to MaxBufferedBody bytes, GetBody or not); the
// key is the body field's string value if it has one, else the one in the
// request's KeyHeader (when KeyHeader is set; else its Idempotency-Key),
// else the pinned one, else a new one, and is then written into the body.
// It always closes req.Body.
func (op *operation) initBodyKey() error {
	req, t := op.req, op.t
	field := t.keyBodyField()
	if h := t.keyHeaderName(); h != "" {
		op.header = textproto.CanonicalMIMEHeaderKey(h)
	}
	if op.header == "" {
		if vs, _ := headerValues(req.Header, DefaultKeyHeader); len(vs) > 0 {
			// The caller's own key header is read as KeyHeader's would
			// be: else it would go on the wire beside another key in the
			// body.
			op.header = DefaultKeyHeader
		}
	}
	fail := func(format string, args ...any) error {
		return fmt.Errorf("%w %q: "+format, append([]any{ErrKeyBodyField, field}, args...)...)
	}
	if !utf8.ValidString(field) {
		closeBody(req)
		return fail("the field name is not valid UTF-8")
	}
	limit := t.maxBuffered()
	if limit < 0 {
		closeBody(req)
		return fail("MaxBufferedBody is negative, so no body can be rewritten")
	}
	// Room for the field and a UUID, so that the usual insertion does not
	// allocate again.
	data, err := readRequestBody(req, limit, len(field)+64)
	if err != nil {
		return err
	}
	if int64(len(data)) > limit {
		return fail("the body is larger than MaxBufferedBody (%d bytes)", limit)
	}
	if req.ContentLength > 0 && req.ContentLength != int64(len(data)) {
		// As for a body buffered without a field: refused, as net/http does.
		return fmt.Errorf("idem: http: ContentLength=%d with Body length %d", req.ContentLength, len(data))
	}
	open, raw, err := findField(data, field)
	if err != nil {
		return fail("%w", err)
	}
	var vs []string // the key header's values, when there is a key header
	if op.header != "" {
		vs, op.respelt = headerValues(req.Header, op.header)
	}
	if raw != nil {
		key, ok := unquote(raw)
		if !ok {
			return fail("the body's value is not a string")
		}
		if err := keyheader.Validate(key); err != nil {
			return fmt.Errorf("idem: the request's body field %q: %w", field, err)
		}
		noteSentKey(req.Context(), key) // not the pinned one, for a Client
		op.key, op.val = key, keyheader.Format(key, t.keyFormat() == KeySFString)
		if len(vs) > 0 {
			hkey, val, _, err := keyFor(req, vs, op.header, t.keyFormat(), t.NewKey)
			if err != nil {
				return err
			}
			if hkey != key {
				return fmt.Errorf("idem: the request's %s header and body field %q hold different keys", op.header, field)
			}
			op.val = val
		}
	} else {
		op.key, op.val, op.newKey, err = keyFor(req, vs, op.header, t.keyFormat(), t.NewKey)
		if err != nil {
			return err
		}
		data = insertField(data, open, field, op.key)
	}
	op.body.setBytes(data)
	return nil
}

// readRequestBody reads and closes the body of req, up to limit+1 bytes
// (so that a longer body is seen as such), and stops when the request's
// context ends, as buffering a body without GetBody does (see
// copyUntilDone). The buffer is sized for the request's ContentLength (up
// to 64 KiB) plus extra bytes, so that inserting the key field into a body
// of that size does not grow it.
func readRequestBody(req *http.Request, limit int64, extra int) ([]byte, error) {
	if req.Body == nil || req.Body == http.NoBody {
		return nil, nil
	}
	defer req.Body.Close()
	size := min(plusOne(limit), 64<<10)
	if req.ContentLength > 0 && req.ContentLength <= limit {
		// +1 to see io.EOF without growing; at most 64 KiB up front, as
		// ContentLength may claim more than the body holds.
		size = min(req.ContentLength, 64<<10) + 1 + int64(extra)
	}
	buf := bytes.NewBuffer(make([]byte, 0, size+bytes.MinRead)) // ReadFrom wants MinRead free
	if _, err := copyUntilDone(req.Context(), buf, io.LimitReader(req.Body, plusOne(limit)), req.Body); err != nil {
		return nil, fmt.Errorf("idem: reading request body: %w", err)
	}
	return buf.Bytes(), nil
}

// setBytes makes data the body of every attempt.
func (b *body) setBytes(data []byte) {
	b.length = int64(len(data))
	b.replayable = true
	b.getBody = func() (io.ReadCloser, error) {
		r := new(bytesBody)
		r.Reset(data)
		return r, nil
	}
	b.first, _ = b.getBody()
	b.firstMem = true
}

// bytesBody is a request body over bytes: one allocation where
// io.NopCloser(bytes.NewReader(data)) makes two.
type bytesBody struct{ bytes.Reader }

// Close does nothing.
func (*bytesBody) Close() error { return nil }

// Reasons findField gives for a body that cannot carry the key.
var (
	errNotJSON   = errors.New("the body is not valid JSON")
	errNotObject = errors.New("the body is not a JSON object")
	errDuplicate = errors.New("the body names the field more than once")
)

// findField checks that data is one JSON object and returns the offset of
// its opening brace and the raw value of its top-level member named name,
// or nil if it has none. Member names are compared once unescaped, as a
// JSON decoder sees them ("idempotency\u005fkey" is "idempotency_key"),
// and exactly (case matters). Members of nested objects do not count. A
// name that appears twice is an error: servers differ on which one wins.
func findField(data []byte, name string) (open int, raw []byte, err error) {
	if !json.Valid(data) || !utf8.Valid(data) { // RFC 8259 JSON is UTF-8
		if len(bytes.TrimLeft(data, " \t\r\n")) == 0 {
			return 0, nil, errNotObject
		}
		return 0, nil, errNotJSON
	}
	// data is valid JSON from here on, so the scan below needs no checks.
	i := skipSpace(data, 0)
	if data[i] != '{' {
		return 0, nil, errNotObject
	}
	open = i
	i = skipSpace(data, i+1)
	if data[i] == '}' {
		return open, nil, nil
	}
	for {
		start := i
		i = skipString(data, i)
		member := data[start:i]
		i = skipSpace(data, i)
		i = skipSpace(data, i+1) // the colon
		valStart := i
		i = skipValue(data, i)
		if nameIs(member, name) {
			if raw != nil {
				return 0, nil, errDuplicate
			}
			raw = data[valStart:i]
		}
		i = skipSpace(data, i)
		if data[i] == '}' {
			return open, raw, nil
		}
		i = skipSpace(data, i+1) // the comma
	}
}

// nameIs reports whether the JSON string literal lit denotes name.
func nameIs(lit []byte, name string) bool {
	inner := lit[1 : len(lit)-1]
	if bytes.IndexByte(inner, '\\') < 0 {
		return string(inner) == name // no allocation
	}
	s, ok := unquote(lit)
	return ok && s == name
}

// unquote returns the string that the JSON value raw denotes, or false if
// raw is not a string.
func unquote(raw []byte) (string, bool) {
	if raw[0] != '"' {
		return "", false
	}
	if inner := raw[1 : len(raw)-1]; bytes.IndexByte(inner, '\\') < 0 {
		return string(inner), true
	}
	var s string
	return s, json.Unmarshal(raw, &s) == nil
}

func skipSpace(data []byte, i int) int {
	for i < len(data) {
		switch data[i] {
		case ' ', '\t', '\r', '\n':
			i++
		default:
			return i
		}
	}
	return i
}

// skipString returns the offset after the string literal at data[i].
func skipString(data []byte, i int) int {
	for i++; ; i++ {
		switch data[i] {
		case '\\':
			i++ // the escaped byte; \uXXXX's digits need no care
		case '"':
			return i + 1
		}
	}
}

// skipValue returns the offset after the JSON value at data[i].
func skipValue(data []byte, i int) int {
	switch data[i] {
	case '"':
		return skipString(data, i)
	case '{', '[':
		depth := 0
		for {
			switch data[i] {
			case '"':
				i = skipString(data, i)
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1
				}
			}
			i++
		}
	}
	for i < len(data) { // a number, true, false or null
		switch data[i] {
		case ',', '}', ']', ' ', '\t', '\r', '\n':
			return i
		}
		i++
	}
	return i
}

// insertField inserts the member "name":"key" as the first member of the
// object whose opening brace is at data[open], keeping every other byte.
// It grows data in place when its capacity allows.
func insertField(data []byte, open int, name, key string) []byte {
	var buf [128]byte // on the stack; enough for the usual names and keys
	member := appendJSONString(buf[:0], name)
	member = append(member, ':')
	member = appendJSONString(member, key)
	if data[skipSpace(data, open+1)] != '}' {
		member = append(member, ',')
	}
	n := len(data)
	data = append(data, member...) // grow; the bytes are overwritten below
	copy(data[open+1+len(member):], data[open+1:n])
	copy(data[open+1:], member)
	return data
}

// appendJSONString appends s to b as a JSON string literal. Only the
// characters JSON requires are escaped: '"', '\\' and controls.
func appendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c < 0x20:
			b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
		default:
			b = append(b, c)
		}
	}
	return append(b, '"')
}
