package idem

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/iotest"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestLostAnswerIsRecovered checks that a keyed request whose 2xx answer
// is cut while its body is read gets it whole all the same: the answer is
// read inside the attempt, and the cut retried with the same key, which
// the server answers with its stored reply. Over HTTP/1.1 and HTTP/2.
func TestLostAnswerIsRecovered(t *testing.T) {
	const answer = `{"id":"pay_123","amount":4200,"currency":"usd","customer":"cus_123"}`
	for _, h2 := range []bool{false, true} {
		t.Run(fmt.Sprintf("HTTP/2 %t", h2), func(t *testing.T) {
			var mu sync.Mutex
			var keys []string
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				mu.Lock()
				keys = append(keys, r.Header.Get(DefaultKeyHeader))
				n := len(keys)
				mu.Unlock()
				w.Header().Set("Content-Type", "application/json")
				w.Header().Set("Content-Length", fmt.Sprint(len(answer)))
				w.WriteHeader(http.StatusCreated)
				if n == 1 {
					// The payment is made; its answer is cut halfway.
					io.WriteString(w, answer[:20])
					w.(http.Flusher).Flush()
					panic(http.ErrAbortHandler)
				}
				w.Header().Set("Idempotent-Replayed", "true")
				io.WriteString(w, answer)
			})
			var srv = newServer(t, h)
			base := http.RoundTripper(nil)
			if h2 {
				srv = newHTTP2Server(t, h)
				base = srv.Client().Transport
			} else {
				b := &http.Transport{}
				t.Cleanup(b.CloseIdleConnections)
				base = b
			}
			tr := &Transport{Base: base, Retry: fastPolicy}
			resp, err := post(t, tr, context.Background(), srv.URL+"/v1/payments", `{"amount":4200}`)
			require.NoError(t, err)
			assert.Equal(t, http.StatusCreated, resp.StatusCode)
			assert.Equal(t, answer, readAll(t, resp), "the whole answer, from the replay")
			mu.Lock()
			defer mu.Unlock()
			require.Len(t, keys, 2)
			assert.Equal(t, keys[0], keys[1])
		})
	}
}

// TestAnswersNotBuffered checks what is handed over unread, as before:
// answers over MaxBufferedResponse, of unknown length, to unkeyed
// requests, or with buffering off; their cut bodies fail the caller's
// read, and nothing is sent again.
func TestAnswersNotBuffered(t *testing.T) {
	const answer = `{"id":"pay_123","amount":4200}`
	for _, tt := range []struct {
		name          string
		method        string
		max           int64
		contentLength bool
	}{
		{"larger than MaxBufferedResponse", http.MethodPost, 10, true},
		{"unknown length", http.MethodPost, 0, false},
		{"unkeyed", http.MethodPut, 0, true},
		{"buffering off", http.MethodPost, -1, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var mu sync.Mutex
			var n int
			srv := newServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				n++
				mu.Unlock()
				if tt.contentLength {
					w.Header().Set("Content-Length", fmt.Sprint(len(answer)))
				}
				w.WriteHeader(http.StatusOK)
				io.WriteString(w, answer[:10])
				w.(http.Flusher).Flush()
				panic(http.ErrAbortHandler)
			}))
			tr := newTransport(t, fastPolicy)
			tr.MaxBufferedResponse = tt.max
			req, err := http.NewRequest(tt.method, srv.URL, strings.NewReader(`{}`))
			require.NoError(t, err)
			resp, err := tr.RoundTrip(req)
			require.NoError(t, err)
			defer resp.Body.Close()
			_, err = io.ReadAll(resp.Body)
			assert.Error(t, err, "the cut is the caller's to see")
			mu.Lock()
			defer mu.Unlock()
			assert.Equal(t, 1, n)
		})
	}
}

// TestSynctestAnswerReadWithinAttemptTimeout checks that AttemptTimeout
// bounds the read of a buffered answer: a body that stalls is an attempt
// timeout, retried with the same key.
func TestSynctestAnswerReadWithinAttemptTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const answer = `{"id":"pay_123"}`
		srv := newFake(func(req *http.Request) (*http.Response, error) {
			resp, _ := replyBody(201, "application/json", answer)(req)
			body := newStallingBody(answer[:5])
			// As net/http's, the body ends when the request's context does.
			context.AfterFunc(req.Context(), func() { body.Close() })
			resp.Body = body
			return resp, nil
		}, replyBody(201, "application/json", answer))
		start := time.Now()
		resp, err := fakePost(t, &Transport{Base: srv, Retry: RetryPolicy{AttemptTimeout: 2 * time.Second}}, context.Background())
		require.NoError(t, err)
		assert.Equal(t, answer, readAll(t, resp))
		require.Len(t, srv.keys, 2)
		assert.Equal(t, srv.keys[0], srv.keys[1])
		assert.GreaterOrEqual(t, time.Since(start), 2*time.Second, "the first attempt timed out")
	})
}

// fillBase answers every request 201 with a body of n bytes, all the
// same letter, a different one for each answer in turn, named in the
// X-Fill header: a body that shows a byte of another answer's is caught.
func fillBase(n int) roundTripFunc {
	var count atomic.Int32
	return func(req *http.Request) (*http.Response, error) {
		if req.Body != nil {
			_, _ = io.Copy(io.Discard, req.Body)
			req.Body.Close()
		}
		fill := 'a' + byte(count.Add(1)%26)
		return &http.Response{
			Status: "201 Created", StatusCode: http.StatusCreated,
			Header:        http.Header{"X-Fill": {string(fill)}},
			Body:          io.NopCloser(bytes.NewReader(bytes.Repeat([]byte{fill}, n))),
			ContentLength: int64(n), Request: req,
		}, nil
	}
}

// checkFill reads what body gives in small reads, or through WriteTo,
// and fails the test on any byte that is not fill. It returns the error
// that ended the reading.
func checkFill(t *testing.T, body io.Reader, fill byte, writeTo bool) error {
	check := func(p []byte) {
		if i := bytes.IndexFunc(p, func(r rune) bool { return r != rune(fill) }); i >= 0 {
			t.Errorf("a body of %q shows %q: another answer's bytes", fill, p[i])
		}
	}
	if writeTo {
		_, err := body.(io.WriterTo).WriteTo(writerFunc(func(p []byte) (int, error) {
			for i := range p { // slowly, byte by byte, so a Close comes in the middle
				check(p[i : i+1])
				runtime.Gosched()
			}
			return len(p), nil
		}))
		return err
	}
	p := make([]byte, 7)
	for {
		n, err := body.Read(p)
		check(p[:n])
		if err != nil {
			return err
		}
		runtime.Gosched()
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// TestAnswerBufferNeverShared checks that the pooled buffer of an answer
// read inside its attempt is never seen through another answer's body:
// many answers of one size class are read at once, in small reads and
// through WriteTo, and closed from another goroutine in the middle of a
// read, while more answers take buffers from the pool. A buffer given back
// while a read of it is running would show its next answer's letter here,
// and the race detector would see the writes under the read.
func TestAnswerBufferNeverShared(t *testing.T) {
	tr := &Transport{Base: fillBase(300)}
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 100 {
				req, err := http.NewRequest(http.MethodPost, mockURL, strings.NewReader(`{}`))
				if err != nil {
					t.Error(err)
					return
				}
				resp, err := tr.RoundTrip(req)
				if err != nil {
					t.Error(err)
					return
				}
				if _, ok := resp.Body.(*answerBody); !ok {
					t.Errorf("the answer was not read inside its attempt: its body is a %T", resp.Body)
					return
				}
				fill := resp.Header.Get("X-Fill")[0]
				closed := make(chan struct{})
				go func() { // closes the body in the middle of the read, or after it
					defer close(closed)
					for range i % 5 {
						runtime.Gosched()
					}
					resp.Body.Close()
				}()
				err = checkFill(t, resp.Body, fill, g%2 == 1)
				if err != io.EOF && err != errAnswerClosed && err != nil {
					t.Errorf("the read ended with %v", err)
				}
				<-closed
				// Read after Close: an error, never bytes, whoever has the buffer now.
				if n, err := resp.Body.Read(make([]byte, 8)); n != 0 || err != errAnswerClosed {
					t.Errorf("a Read after Close got %d bytes, %v; want none and errAnswerClosed", n, err)
				}
			}
		})
	}
	wg.Wait()
}

// TestAnswerReadAfterClose checks that a body closed halfway returns an
// error to a later Read, also once its buffer serves the next answer: the
// buffer is given back on Close, and the next answer of its size class may
// get it, but the closed body does not show it.
func TestAnswerReadAfterClose(t *testing.T) {
	tr := &Transport{Base: fillBase(100)}
	get := func() (*http.Response, byte) {
		req, err := http.NewRequest(http.MethodPost, mockURL, strings.NewReader(`{}`))
		require.NoError(t, err)
		resp, err := tr.RoundTrip(req)
		require.NoError(t, err)
		return resp, resp.Header.Get("X-Fill")[0]
	}
	for range 20 {
		first, fill := get()
		p := make([]byte, 40)
		n, err := first.Body.Read(p)
		require.NoError(t, err)
		assert.Equal(t, bytes.Repeat([]byte{fill}, n), p[:n])
		require.NoError(t, first.Body.Close())
		require.NoError(t, first.Body.Close(), "a second Close")
		second, fill2 := get() // likely on the first one's buffer
		n, err = first.Body.Read(p)
		assert.Equal(t, 0, n)
		assert.ErrorIs(t, err, errAnswerClosed)
		_, err = first.Body.(io.WriterTo).WriteTo(io.Discard)
		assert.ErrorIs(t, err, errAnswerClosed)
		assert.Equal(t, strings.Repeat(string(fill2), 100), readAll(t, second))
	}
}

// TestReadAnswerWhateverTheReadsReturn: an answer of known length is read
// whole however its body's reads split it, with io.EOF beside the last
// bytes or after them; one that ends short is an error, an unexpected EOF
// as net/http's own short bodies say; one longer than it said is handed
// over as it came, every byte.
func TestReadAnswerWhateverTheReadsReturn(t *testing.T) {
	const answer = `{"id":"pay_1"}`
	for _, tt := range []struct {
		name    string
		body    func() io.Reader
		length  int64
		want    string
		wantErr bool
	}{
		{"EOF after", func() io.Reader { return strings.NewReader(answer) }, int64(len(answer)), answer, false},
		{"EOF beside the data", func() io.Reader { return iotest.DataErrReader(strings.NewReader(answer)) }, int64(len(answer)), answer, false},
		{"one byte a read", func() io.Reader { return iotest.OneByteReader(strings.NewReader(answer)) }, int64(len(answer)), answer, false},
		{"half a read", func() io.Reader { return iotest.HalfReader(strings.NewReader(answer)) }, int64(len(answer)), answer, false},
		{"shorter", func() io.Reader { return strings.NewReader(answer[:5]) }, int64(len(answer)), "", true},
		{"shorter, EOF beside the data", func() io.Reader { return iotest.DataErrReader(strings.NewReader(answer[:5])) }, int64(len(answer)), "", true},
		{"empty", func() io.Reader { return strings.NewReader("") }, int64(len(answer)), "", true},
		{"longer", func() io.Reader { return strings.NewReader(answer) }, 5, answer, false},
		{"longer, EOF beside the data", func() io.Reader { return iotest.DataErrReader(strings.NewReader(answer)) }, 5, answer, false},
		{"read error", func() io.Reader {
			return io.MultiReader(strings.NewReader(answer[:3]), iotest.ErrReader(io.ErrClosedPipe))
		}, int64(len(answer)), "", true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			resp := &http.Response{Status: "201 Created", StatusCode: 201, ContentLength: tt.length, Body: io.NopCloser(tt.body())}
			ar := &attemptRequest{ctx: attemptContext{kit: newKit()}}
			closed, err := readAnswer(resp, ar)
			if tt.wantErr {
				assert.True(t, closed, "the body is closed")
				assert.Error(t, err)
				if !strings.HasPrefix(tt.name, "read error") {
					assert.ErrorIs(t, err, io.ErrUnexpectedEOF)
				}
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.length == int64(len(answer)), closed, "the body is closed unless it was longer than it said")
			got, err := io.ReadAll(resp.Body)
			require.NoError(t, err)
			assert.Equal(t, tt.want, string(got))
			resp.Body.Close()
		})
	}
}
