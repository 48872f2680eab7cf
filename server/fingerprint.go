package server

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/url"
	"slices"
	"strings"
	"unicode/utf8"
)

// FingerprintVersion is the version of the canonical request form that
// [Fingerprint] computes by default. It is stored with every key
// ([ClaimRequest.FingerprintVersion], [Record.FingerprintVersion]), so the
// canonical form can evolve: a retry that meets a record of an older version
// is fingerprinted again with that version before it is compared, and an old
// retry never turns into a 422 because the server was upgraded.
const FingerprintVersion = 1

// maxJSONDepth bounds the nesting of a JSON body the canonicaliser accepts.
const maxJSONDepth = 1000

// Errors returned by [Fingerprint]. The middleware answers both with 400
// invalid-request before it claims the key, so nothing is stored.
var (
	// ErrFingerprintVersion: the version is not one this server knows.
	ErrFingerprintVersion = errors.New("server: unknown fingerprint version")
	// ErrBody: the body is not well-formed for its media type (see
	// [Fingerprint] for what version 1 rejects).
	ErrBody = errors.New("server: malformed request body")
)

// Fingerprint returns the SHA-256 fingerprint of a request: its method, its
// path, its query and its body in canonical form, computed with the given
// version of the canonical form. contentType is the request's Content-Type
// header; it chooses how the body is canonicalised.
//
// Canonical form, version 1. The body is canonicalised by media type:
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
//     pairs are sorted by name, then by value, and re-encoded with
//     [url.QueryEscape] joined by '&'. Repeated fields are therefore
//     compared as a multiset: a=1&a=2 equals a=2&a=1.
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
// Fingerprint returns [ErrFingerprintVersion] for an unknown version and an
// error wrapping [ErrBody] for a body it cannot canonicalise. It is safe for
// concurrent use.
func Fingerprint(version int, method, path, rawQuery, contentType string, body []byte) ([]byte, error) {
	if version != 1 {
		return nil, fmt.Errorf("%w %d", ErrFingerprintVersion, version)
	}
	query, err := canonicalForm(rawQuery)
	if err != nil {
		return nil, fmt.Errorf("%w: query: %v", ErrBody, err)
	}
	kind, canon, err := CanonicalBody(contentType, body)
	if err != nil {
		return nil, err
	}
	h := sha256.New()
	io.WriteString(h, "idem-fingerprint-v1")
	for _, field := range [][]byte{[]byte(method), []byte(path), []byte(query), []byte(kind), canon} {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(field)))
		h.Write(n[:])
		h.Write(field)
	}
	return h.Sum(nil), nil
}

// CanonicalBody returns the version 1 canonical form of a body of the given
// Content-Type and the kind of canonicalisation applied ("json", "form",
// "raw", or "" for an empty body), as described on [Fingerprint]. It is
// exported so that a developer can see exactly what is compared; the
// returned bytes are not an API format.
func CanonicalBody(contentType string, body []byte) (kind string, canon []byte, err error) {
	if len(body) == 0 {
		return "", nil, nil
	}
	switch mediaKind(contentType) {
	case "json":
		canon, err := canonicalJSON(body)
		if err != nil {
			return "", nil, fmt.Errorf("%w: JSON: %v", ErrBody, err)
		}
		return "json", canon, nil
	case "form":
		canon, err := canonicalForm(string(body))
		if err != nil {
			return "", nil, fmt.Errorf("%w: form: %v", ErrBody, err)
		}
		return "form", []byte(canon), nil
	default:
		return "raw", body, nil
	}
}

// mediaKind classifies a Content-Type header value.
func mediaKind(contentType string) string {
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

// canonicalForm sorts the pairs of a form-encoded string by name, then value.
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
	slices.SortFunc(pairs, func(a, b [2]string) int {
		if c := strings.Compare(a[0], b[0]); c != 0 {
			return c
		}
		return strings.Compare(a[1], b[1])
	})
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

// canonicalJSON writes body in the version 1 canonical JSON form.
func canonicalJSON(body []byte) ([]byte, error) {
	if !utf8.Valid(body) {
		return nil, errors.New("invalid UTF-8")
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var out bytes.Buffer
	out.Grow(len(body))
	if err := writeCanonical(&out, dec, 0); err != nil {
		return nil, err
	}
	if len(bytes.TrimLeft(body[dec.InputOffset():], " \t\r\n")) > 0 {
		return nil, errors.New("data after the top-level value")
	}
	return out.Bytes(), nil
}

// writeCanonical reads one JSON value from dec and writes its canonical form.
func writeCanonical(out *bytes.Buffer, dec *json.Decoder, depth int) error {
	if depth > maxJSONDepth {
		return fmt.Errorf("nested deeper than %d levels", maxJSONDepth)
	}
	tok, err := dec.Token()
	if err != nil {
		if err == io.EOF {
			return io.ErrUnexpectedEOF
		}
		return err
	}
	switch v := tok.(type) {
	case json.Delim:
		switch v {
		case '{':
			return writeObject(out, dec, depth)
		case '[':
			out.WriteByte('[')
			for i := 0; dec.More(); i++ {
				if i > 0 {
					out.WriteByte(',')
				}
				if err := writeCanonical(out, dec, depth+1); err != nil {
					return err
				}
			}
			if _, err := dec.Token(); err != nil { // ']'
				return err
			}
			out.WriteByte(']')
			return nil
		}
		return fmt.Errorf("unexpected %v", v)
	case string:
		writeString(out, v)
	case json.Number:
		out.WriteString(string(v))
	case bool:
		if v {
			out.WriteString("true")
		} else {
			out.WriteString("false")
		}
	case nil:
		out.WriteString("null")
	}
	return nil
}

// writeObject canonicalises the members of an object whose '{' was read.
func writeObject(out *bytes.Buffer, dec *json.Decoder, depth int) error {
	type member struct {
		key   string
		value []byte
	}
	var members []member
	seen := make(map[string]bool)
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return err
		}
		key, ok := tok.(string)
		if !ok {
			return fmt.Errorf("object key is %T", tok)
		}
		if seen[key] {
			return fmt.Errorf("duplicate key %q", key)
		}
		seen[key] = true
		var value bytes.Buffer
		if err := writeCanonical(&value, dec, depth+1); err != nil {
			return err
		}
		members = append(members, member{key, value.Bytes()})
	}
	if _, err := dec.Token(); err != nil { // '}'
		return err
	}
	slices.SortFunc(members, func(a, b member) int { return strings.Compare(a.key, b.key) })
	out.WriteByte('{')
	for i, m := range members {
		if i > 0 {
			out.WriteByte(',')
		}
		writeString(out, m.key)
		out.WriteByte(':')
		out.Write(m.value)
	}
	out.WriteByte('}')
	return nil
}

// writeString writes s, which is valid UTF-8, as a JSON string escaped as
// encoding/json escapes it with HTML escaping off: '"', '\\' and control
// characters are escaped (\b, \f, \n, \r, \t by name, others as \u00XX), and so
// are U+2028 and U+2029; everything else is written as it is.
func writeString(out *bytes.Buffer, s string) {
	const hex = "0123456789abcdef"
	out.WriteByte('"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' && c < utf8.RuneSelf {
			i++
			continue
		}
		if c >= utf8.RuneSelf {
			r, size := utf8.DecodeRuneInString(s[i:])
			if r != '\u2028' && r != '\u2029' {
				i += size
				continue
			}
			out.WriteString(s[start:i])
			out.WriteString(`\u202`)
			out.WriteByte(hex[r&0xf])
			i += size
			start = i
			continue
		}
		out.WriteString(s[start:i])
		switch c {
		case '"', '\\':
			out.WriteByte('\\')
			out.WriteByte(c)
		case '\n':
			out.WriteString(`\n`)
		case '\r':
			out.WriteString(`\r`)
		case '\t':
			out.WriteString(`\t`)
		case '\b':
			out.WriteString(`\b`)
		case '\f':
			out.WriteString(`\f`)
		default:
			out.WriteString(`\u00`)
			out.WriteByte(hex[c>>4])
			out.WriteByte(hex[c&0xf])
		}
		i++
		start = i
	}
	out.WriteString(s[start:])
	out.WriteByte('"')
}
