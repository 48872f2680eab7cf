package idem

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync/atomic"
)

// localError is an attempt's error that comes from the request itself,
// not from the network or the server: its body's own Read failed, or the
// body's length disagreed with its ContentLength. Sending it again would
// fail the same way, so it is not retried. Its message is its cause's.
type localError struct{ err error }

func (e *localError) Error() string { return e.err.Error() }
func (e *localError) Unwrap() error { return e.err }

// trackedBody is an attempt's request body of a type that is not read from
// memory (a file, a pipe, a reader of the caller's own), whose own Read
// errors and length are noted, so that an attempt that fails on them is
// told apart from one that fails on the network. net/http may read it on its own goroutine, and go on after
// RoundTrip returned, hence the atomics. (Wrapped, an *os.File body is no
// longer sent with sendfile; a payment's body is small, and idem buffers
// bodies without GetBody anyway.)
type trackedBody struct {
	io.ReadCloser
	n   atomic.Int64
	eof atomic.Bool
	err atomic.Pointer[error] // the first error of its own Read, but io.EOF
}

func (b *trackedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n.Add(int64(n))
	switch {
	case err == io.EOF:
		b.eof.Store(true)
	case err != nil:
		b.err.CompareAndSwap(nil, &err)
	}
	return n, err
}

// track returns the body to send for an attempt: body itself, or, for one
// whose reads could fail or run short of its length, body tracked in *t,
// made for it (an in-memory body, the usual one, costs nothing). mem says
// body is known to be in memory (the first attempt's, checked once).
func track(body io.ReadCloser, mem bool, t **trackedBody) io.ReadCloser {
	if mem {
		return body // inlined: the first attempt's body, the usual one
	}
	return trackAny(body, t)
}

func trackAny(body io.ReadCloser, t **trackedBody) io.ReadCloser {
	if body == nil || body == http.NoBody {
		return body
	}
	if _, _, ok := inMemory(body, -1); ok {
		return body // its reads cannot fail, and net/http knows it is in memory
	}
	*t = &trackedBody{ReadCloser: body}
	return *t
}

// local returns err marked as a localError if it comes from the attempt's
// request itself (see localError), else err as it is. length is the
// ContentLength sent. b may be nil: no body was tracked.
func (b *trackedBody) local(err error, length int64) error {
	if b == nil || err == nil {
		return err // inlined
	}
	return b.judge(err, length)
}

func (b *trackedBody) judge(err error, length int64) error {
	if e := b.err.Load(); e != nil && errors.Is(err, *e) {
		return &localError{err}
	}
	if length > 0 && b.eof.Load() && b.n.Load() != length {
		// net/http refuses such a body once it has read it, and says so
		// in err ("http: ContentLength=100 with Body length 5").
		return &localError{err}
	}
	return err
}

// checkLength refuses, before anything is sent, a request whose
// ContentLength disagrees with its body, when the body's length can be
// known without reading it: no body, or an in-memory one. net/http would
// refuse it after writing (part of) it. left is what is left to read of
// req.Body if mem says it is in memory (see inMemory).
func checkLength(req *http.Request, left int64, mem bool) error {
	if req.ContentLength <= 0 {
		return nil // unknown (0 with a body), or none
	}
	if req.Body == nil || req.Body == http.NoBody {
		return fmt.Errorf("idem: http: Request.ContentLength=%d with nil Body", req.ContentLength)
	}
	if mem && left != req.ContentLength {
		return fmt.Errorf("idem: http: ContentLength=%d with Body length %d", req.ContentLength, left)
	}
	return nil
}
