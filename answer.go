package idem

import (
	"errors"
	"fmt"
	"io"
	"math/bits"
	"net/http"
	"sync"
	"sync/atomic"
)

// The buffers of answers read inside their attempts come from pools, one
// per size class, so that a first-try success allocates none: 256 bytes,
// and each power of two above it up to DefaultMaxBufferedResponse. (A
// buffer holds the answer and one byte more, to see where it ends.) An
// attempt's kit (attempt.go) keeps the buffer of the last answer it held,
// and takes one of another class from its pool, giving its own back, only
// when an answer needs it; a kit goes back only when the caller closes the
// body and no Read or WriteTo of it is running. A larger answer
// (MaxBufferedResponse above the default) gets a buffer of its own.
const (
	minAnswerShift = 8 // 256 bytes
	minAnswerClass = 1 << minAnswerShift
	answerClasses  = 9 // 256 bytes to 64 KiB
)

var answerPools [answerClasses]sync.Pool

// answerBuf holds a pooled buffer; the pool holds the pointer, which an
// interface carries without allocating.
type answerBuf struct{ b []byte }

// answerClass returns the index in answerPools of the class that holds n
// bytes, len(answerPools) or more if none does.
func answerClass(n int64) int {
	if n <= minAnswerClass {
		return 0
	}
	return bits.Len64(uint64(n-1)) - minAnswerShift
}

// getAnswerBuf returns a buffer of n bytes, from its class's pool if it
// has one.
func getAnswerBuf(n int64) *answerBuf {
	c := answerClass(n)
	if c >= len(answerPools) {
		return &answerBuf{b: make([]byte, n)}
	}
	if a, ok := answerPools[c].Get().(*answerBuf); ok {
		a.b = a.b[:n]
		return a
	}
	return &answerBuf{b: make([]byte, n, minAnswerClass<<c)}
}

// putAnswerBuf gives a buffer back to its class's pool; one of its own is
// left to the garbage collector. Nothing may read or write a buffer once
// it is given back.
func putAnswerBuf(a *answerBuf) {
	if pooledClass(a) {
		answerPools[answerClass(int64(cap(a.b)))].Put(a)
	}
}

// pooledClass reports whether a is a buffer of one of the pools' classes,
// not one of its own.
func pooledClass(a *answerBuf) bool {
	c := answerClass(int64(cap(a.b)))
	return c < len(answerPools) && cap(a.b) == minAnswerClass<<c
}

// answerBuf returns a buffer of n bytes for the attempt's answer, which k
// holds from then on: the one it holds if that is of n's class, else one
// of that class (the one it held going back to its pool).
func (k *kit) answerBuf(n int64) *answerBuf {
	if a := k.buf; a != nil {
		if c := answerClass(n); c < len(answerPools) && cap(a.b) == minAnswerClass<<c {
			a.b = a.b[:n]
			return a
		}
		putAnswerBuf(a)
	}
	k.buf = getAnswerBuf(n)
	return k.buf
}

// answerBody is the body of an answer read inside its attempt, into the
// buffer of the attempt's kit (attempt.go): the attempt's own object seen
// as a body, which finds the kit in the attempt's context and needs no
// pointer of its own to it. Close gives the kit back, once no Read or
// WriteTo is running (a Close from another goroutine, as net/http allows,
// waits for nothing and lets the last of them give it back), and a Read
// after Close returns an error, never the bytes of the answer that took
// the kit over. The attempt's object is never used again.
type answerBody attemptRequest

// answerState is the state of an attempt's answerBody.
type answerState struct {
	off int // how much of the answer has been read
	// state is 1 while the body is open, plus 2 for each Read or WriteTo
	// running; the kit is given back when it falls to 0.
	state atomic.Int32
}

// errAnswerClosed is the error of a Read after Close, as net/http's.
var errAnswerClosed = errors.New("idem: read on closed response body")

// open makes a the body of the answer in its kit's buffer.
func (a *answerBody) open() {
	a.answer.off = 0
	a.answer.state.Store(1)
}

// hold counts a Read or WriteTo in, if the body is still open.
func (a *answerBody) hold() bool {
	for {
		s := a.answer.state.Load()
		if s&1 == 0 {
			return false
		}
		if a.answer.state.CompareAndSwap(s, s+2) {
			return true
		}
	}
}

// release counts a Read or WriteTo out, and gives the kit back if the
// body was closed meanwhile.
func (a *answerBody) release() {
	if a.answer.state.Add(-2) == 0 {
		a.ctx.kit.giveBack()
	}
}

func (a *answerBody) Read(p []byte) (int, error) {
	if !a.hold() {
		return 0, errAnswerClosed
	}
	n := copy(p, a.ctx.kit.buf.b[a.answer.off:])
	a.answer.off += n
	a.release()
	if n == 0 && len(p) > 0 {
		return 0, io.EOF
	}
	return n, nil
}

// WriteTo writes what is left to w, for io.Copy.
func (a *answerBody) WriteTo(w io.Writer) (int64, error) {
	if !a.hold() {
		return 0, errAnswerClosed
	}
	n, err := w.Write(a.ctx.kit.buf.b[a.answer.off:])
	a.answer.off += n
	a.release()
	return int64(n), err
}

// Close gives the kit back, or leaves that to the last Read or WriteTo
// still running.
func (a *answerBody) Close() error {
	if a.answer.state.And(^1) == 1 {
		a.ctx.kit.giveBack()
	}
	return nil
}

func (t *Transport) maxAnswer() int64 {
	if t.MaxBufferedResponse == 0 {
		return DefaultMaxBufferedResponse
	}
	return t.MaxBufferedResponse
}

// readAnswer reads the body of resp, of known length, whole, into a buffer
// that ar's kit holds, and makes ar, as an answerBody, the body; or, if it cannot,
// closes the body and returns why. It reports whether it closed the body
// it read: not when the body was longer than it said, then handed over
// with what was read of it first, in a buffer of the caller's.
func readAnswer(resp *http.Response, ar *attemptRequest) (closed bool, err error) {
	k := ar.ctx.kit
	a := k.answerBuf(plusOne(resp.ContentLength)) // +1 to see the end
	// io.ReadFull's loop, without its calls: net/http's body returns the
	// whole answer and io.EOF in one Read.
	n, err := resp.Body.Read(a.b)
	for n < len(a.b) && err == nil {
		var more int
		more, err = resp.Body.Read(a.b[n:])
		n += more
	}
	switch {
	case int64(n) == resp.ContentLength && (err == io.EOF || err == io.ErrUnexpectedEOF):
		// It ended where it said it would. (net/http's own short body
		// ends with io.ErrUnexpectedEOF too, but before its length.)
	case n == len(a.b):
		// Longer than it said (a Base, not net/http): handed over as it
		// came, what was read first. The buffer is the caller's now, and
		// never goes back to its pool.
		k.buf = nil
		resp.Body = &peekedBody{prefix: a.b, rest: resp.Body}
		return false, nil
	default:
		if err == io.EOF {
			err = io.ErrUnexpectedEOF // short of its length, as io.ReadFull says it
		}
		resp.Body.Close()
		return true, fmt.Errorf("idem: reading the %s answer: %w", resp.Status, err)
	}
	resp.Body.Close()
	a.b = a.b[:n]
	into := (*answerBody)(ar)
	into.open()
	resp.Body = into
	return true, nil
}
