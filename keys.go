package idem

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"

	"github.com/google/uuid"

	"github.com/idemkit/idem/internal/keyheader"
)

// DefaultKeyHeader is the header that carries the idempotency key unless
// [Transport.KeyHeader] names another.
const DefaultKeyHeader = "Idempotency-Key"

// MaxKeyLen is the longest key idem sends or accepts: 255 bytes. It is
// Stripe's limit and the reference server's.
const MaxKeyLen = 255

// The reference server's limit is the same.
var _ [MaxKeyLen - keyheader.MaxLen]struct{}
var _ [keyheader.MaxLen - MaxKeyLen]struct{}

// KeyFormat says how the key is written in its header.
type KeyFormat int

const (
	// KeyBare writes the key as it is: Idempotency-Key: 8e03978e-…,
	// as Stripe and most APIs expect. It is the default.
	KeyBare KeyFormat = iota
	// KeySFString writes the key as an RFC 9651 sf-string, as the IETF
	// draft defines the header: Idempotency-Key: "8e03978e-…".
	KeySFString
)

// NewKey returns a new random idempotency key: a version 4 UUID in its
// canonical form, such as "8e03978e-40d5-43e8-bc93-6894a57f9324".
// It panics only if the system's random source fails, as uuid.New does.
func NewKey() string {
	return uuid.NewString()
}

type keyContextKey struct{}

// WithKey returns a copy of ctx that pins the idempotency key of the
// operation sent with it. Use it to retry one logical operation across
// calls (after a crash, or when [InProgressError] says to retry later):
// every request sent with the returned context carries key.
//
// A key must be 1 to [MaxKeyLen] visible ASCII characters; [Transport]
// rejects any other key before sending. Never reuse a key for a different
// request: the server answers 422 and the Transport returns a
// [*KeyReuseError].
func WithKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, keyContextKey{}, key)
}

// KeyFromContext returns the key pinned on ctx by [WithKey].
func KeyFromContext(ctx context.Context) (string, bool) {
	switch v := ctx.Value(keyContextKey{}).(type) {
	case string:
		return v, true
	case *clientKey:
		return v.key, true
	}
	return "", false
}

// clientKey is a key pinned by [Client], which must name the key sent in
// its errors: the Transport notes here a key it sends instead, one
// already in the body's KeyBodyField.
type clientKey struct {
	key  string
	made bool // by the Client, for this call: not the caller's
	sent atomic.Pointer[string]
}

// withClientKey returns a copy of ctx that pins key, as WithKey does, and
// the clientKey that tells the key sent.
func withClientKey(ctx context.Context, key string, made bool) (context.Context, *clientKey) {
	ck := &clientKey{key: key, made: made}
	return context.WithValue(ctx, keyContextKey{}, ck), ck
}

// sentKey returns the key sent under ck: the pinned one, unless the
// Transport noted another.
func (ck *clientKey) sentKey() string {
	if p := ck.sent.Load(); p != nil {
		return *p
	}
	return ck.key
}

// noteSentKey tells a Client that pinned a key on ctx that key is the one
// sent instead.
func noteSentKey(ctx context.Context, key string) {
	if ck, ok := ctx.Value(keyContextKey{}).(*clientKey); ok && key != ck.key {
		ck.sent.Store(&key)
	}
}

// headerValues returns the values of the header name (canonical) in h
// under any spelling: also those set directly in the map under another
// one, such as h["idempotency-key"], which http.Header's methods do not see
// but net/http sends. respelt reports whether there is such a spelling.
func headerValues(h http.Header, name string) (vs []string, respelt bool) {
	var s headerScan
	s.scan(h, name, "")
	return s.key, s.respelt
}

// headerScan is what one walk of a request's header finds of the key
// header and the first-sent header, under any spelling.
type headerScan struct {
	key         []string // the key header's values
	respelt     bool     // the key header is there under another spelling too
	sent        []string // the first-sent header's values, the canonical spelling's if it has one
	hasSent     bool     // the first-sent header is there
	sentRespelt bool     // under another spelling than the canonical one
	// The header's names, the first maxShapeNames of them, and how many
	// it has, for headerShapes.remember.
	names [maxShapeNames]string
	count int
}

// scan walks h once, and looks nothing up, for the header name and the
// header sentName (both canonical; "" for none), and adds what it finds to
// s. The order of the key header's values matters only when there is a
// single one.
func (s *headerScan) scan(h http.Header, name, sentName string) {
	for k, more := range h {
		if s.count < maxShapeNames {
			s.names[s.count] = k
		}
		s.count++
		// The lengths first: EqualFold of two names costs a call.
		switch {
		case len(k) == len(name) && name != "" && (k == name || strings.EqualFold(k, name)):
			if k != name {
				s.respelt = true
			}
			if s.key == nil {
				s.key = more
			} else {
				s.key = append(s.key[:len(s.key):len(s.key)], more...)
			}
		case len(k) == len(sentName) && sentName != "" && (k == sentName || strings.EqualFold(k, sentName)):
			if !s.hasSent || k == sentName {
				s.sent = more
			}
			if k != sentName {
				s.sentRespelt = true
			}
			s.hasSent = true
		}
	}
}

// keyFor returns the key of the operation req starts and the header value
// to send, in this order of precedence: the key header already on req
// (vs, its values under any spelling, from headerValues), the key pinned on
// its context, a new key from newKey, or from [NewKey] if newKey is nil.
// made reports whether the key was made for the operation (here, or by a
// Client for this call) rather than pinned by the caller.
func keyFor(req *http.Request, vs []string, header string, format KeyFormat, newKey func() string) (key, value string, made bool, err error) {
	if len(vs) > 0 {
		key, err := keyheader.Parse(vs)
		if err != nil {
			return "", "", false, fmt.Errorf("idem: the request's %s header: %w", header, err)
		}
		return key, vs[0], false, nil
	}
	switch v := req.Context().Value(keyContextKey{}).(type) {
	case string:
		key = v
	case *clientKey:
		key, made = v.key, v.made
	default:
		made = true
		if newKey == nil {
			// A UUID is a valid key by construction: not checked again.
			key = NewKey()
			return key, keyheader.Format(key, format == KeySFString), made, nil
		}
		key = newKey()
	}
	if err := keyheader.Validate(key); err != nil {
		return "", "", false, fmt.Errorf("idem: idempotency key %.40q: %w", key, err)
	}
	return key, keyheader.Format(key, format == KeySFString), made, nil
}
