package idem

import (
	"context"
	"net/http"
)

// attemptContext is the context of one attempt's request: the operation's
// context (or the attempt's own cancelable one), carrying the attempt's
// number and key for AttemptFromContext. It also holds the slice element
// that backs the key header's value in the attempt's header copy.
type attemptContext struct {
	context.Context
	number   int
	key      string
	keyValue [1]string
}

// attemptRequest is an attempt's request and its context in one
// allocation: WithContext's copy, inlined, stays on the stack and is copied
// here, its context field included.
type attemptRequest struct {
	req    http.Request
	ctx    attemptContext
	answer answerBody // the body of a 2xx answer read inside the attempt
}

type attemptContextKey struct{}

// Value returns the context itself for attemptContextKey, so that a lookup
// allocates nothing, and defers to the parent for any other key.
func (c *attemptContext) Value(key any) any {
	if key == (attemptContextKey{}) {
		return c
	}
	return c.Context.Value(key)
}

// AttemptFromContext returns the attempt carried by a request's context
// inside [Transport.Base]: the attempt's Number and the operation's Key ("" when
// the method is not keyed). A base transport that traces, signs or logs
// requests uses it to tell the attempts of one operation apart. It reports
// false for a context that did not come from a Transport's attempt.
func AttemptFromContext(ctx context.Context) (Attempt, bool) {
	c, ok := ctx.Value(attemptContextKey{}).(*attemptContext)
	if !ok {
		return Attempt{}, false
	}
	return Attempt{Number: c.number, Key: c.key}, true
}
