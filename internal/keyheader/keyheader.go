// Package keyheader parses and formats the Idempotency-Key header value, for
// the SDK and the reference server alike.
//
// The IETF draft (draft-ietf-httpapi-idempotency-key-header) defines the
// header as an RFC 9651 Item Structured Field whose value is a String, so it
// travels quoted: Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324".
// Stripe and most SDKs send the bare value instead. Parse accepts both: a
// value that starts with a double quote is parsed as an sf-string, anything
// else is taken as the bare key. An sf-string with parameters
// ("abc";x=1) is refused ([ErrParams]): the draft defines none, and
// dropping them would make "abc";x=1 and "abc";x=2 one key.
package keyheader

import (
	"errors"
	"fmt"
	"strings"

	"github.com/dunglas/httpsfv"
)

// MaxLen is the longest key accepted, in bytes (Stripe's limit).
const MaxLen = 255

// Errors returned by [Parse] and [Validate]; callers test them with errors.Is.
var (
	ErrMissing  = errors.New("idempotency key is missing")
	ErrMultiple = errors.New("idempotency key header is sent more than once")
	ErrEmpty    = errors.New("idempotency key is empty")
	ErrTooLong  = fmt.Errorf("idempotency key is longer than %d characters", MaxLen)
	ErrInvalid  = errors.New("idempotency key has characters outside visible ASCII")
	ErrSyntax   = errors.New("idempotency key is not a valid structured-field string")
	// ErrParams is returned for an sf-string with parameters. It is also
	// an [ErrSyntax], for callers that tell only the two forms apart.
	ErrParams error = paramsError{}
)

type paramsError struct{}

func (paramsError) Error() string {
	return "idempotency key has structured-field parameters (;name=value), which are not part of the key"
}

func (paramsError) Is(target error) bool { return target == ErrSyntax }

// Parse returns the key carried by the header lines values (as in
// http.Header.Values). It accepts one line holding either a bare key or an
// RFC 9651 sf-string without parameters, and validates the key with
// [Validate].
func Parse(values []string) (string, error) {
	switch len(values) {
	case 0:
		return "", ErrMissing
	case 1:
	default:
		return "", ErrMultiple
	}
	v := strings.Trim(values[0], " \t")
	if strings.HasPrefix(v, `"`) {
		item, err := httpsfv.UnmarshalItem([]string{v})
		if err != nil {
			return "", ErrSyntax
		}
		s, ok := item.Value.(string)
		if !ok {
			return "", ErrSyntax
		}
		if item.Params != nil && len(item.Params.Names()) > 0 {
			return "", ErrParams
		}
		v = s
	}
	if err := Validate(v); err != nil {
		return "", err
	}
	return v, nil
}

// Validate reports whether key is usable: 1 to [MaxLen] bytes, each a visible
// ASCII character (0x21 to 0x7E).
func Validate(key string) error {
	if key == "" {
		return ErrEmpty
	}
	if len(key) > MaxLen {
		return ErrTooLong
	}
	for i := 0; i < len(key); i++ {
		if c := key[i]; c < 0x21 || c > 0x7e {
			return ErrInvalid
		}
	}
	return nil
}

// Format returns the header value for key: the bare key, or, when sfString
// is true, the key as an RFC 9651 sf-string. A key that starts with a double
// quote is always written as an sf-string, since its bare form would read as
// one. key must pass [Validate].
func Format(key string, sfString bool) string {
	if !sfString && (key == "" || key[0] != '"') {
		return key // inlined
	}
	return quote(key)
}

// quote returns key as an sf-string.
func quote(key string) string {
	var b strings.Builder
	b.Grow(len(key) + 2)
	b.WriteByte('"')
	for i := 0; i < len(key); i++ {
		if c := key[i]; c == '"' || c == '\\' {
			b.WriteByte('\\')
		}
		b.WriteByte(key[i])
	}
	b.WriteByte('"')
	return b.String()
}
