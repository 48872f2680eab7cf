package idempotency

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
)

// credentialHandler answers 201 with every kind of header: those kept by
// default, one of the service's own, credentials, and the ones the server
// or the middleware write.
func credentialHandler(calls *atomic.Int32) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		h := w.Header()
		h.Set("Location", "/v1/payments/pay_1")
		h.Set("Etag", `"v1"`)
		h.Set("Cache-Control", "no-store")
		h.Set("X-Custom", "mine")
		h.Set("Set-Cookie", "session=secret")
		h.Set("Authorization", "Bearer secret")
		h.Set("Www-Authenticate", `Bearer realm="secret"`)
		h.Set("Proxy-Authenticate", "Basic")
		h.Set("Authentication-Info", "nextnonce=secret")
		h.Set("Idempotent-Replayed", "false")
		h.Set(RedactedHeader, "false")
		h.Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"id":"pay_1"}`)
	}
}

// credentialNames are the credential headers credentialHandler sets.
var credentialNames = []string{"Set-Cookie", "Authorization", "Www-Authenticate", "Proxy-Authenticate", "Authentication-Info"}

// storedHeaders returns the headers the memory store holds for client c's
// key.
func storedHeaders(t *testing.T, mem *MemoryStore, key string) map[string]string {
	t.Helper()
	return storedOf(t, mem, "c", key).Header
}

// TestStoredHeadersDefault: by default, a replay carries the headers a
// replay needs (Location, ETag, Cache-Control), not the service's own
// (X-Custom) nor any credential, which the first response carries.
func TestStoredHeadersDefault(t *testing.T) {
	var calls atomic.Int32
	mem := NewMemoryStore()
	ts := mwServer(t, mem, Options{}, credentialHandler(&calls))
	first := ts.mustSend(t, keyed("k", "{}"))
	for _, h := range append([]string{"Location", "X-Custom"}, credentialNames...) {
		if first.header.Get(h) == "" {
			t.Errorf("the first response lost %s", h)
		}
	}
	again := ts.mustSend(t, keyed("k", "{}"))
	if !again.replayed() || calls.Load() != 1 {
		t.Fatalf("retry: %d replayed=%v after %d runs", again.status, again.replayed(), calls.Load())
	}
	for h, want := range map[string]string{"Location": "/v1/payments/pay_1", "Etag": `"v1"`, "Cache-Control": "no-store", "Content-Type": "application/json"} {
		if got := again.header.Get(h); got != want {
			t.Errorf("replayed %s = %q, want %q", h, got, want)
		}
	}
	for _, h := range append([]string{"X-Custom", RedactedHeader}, credentialNames...) {
		if v := again.header.Values(h); v != nil {
			t.Errorf("replayed %s: %q, want none", h, v)
		}
	}
	got := storedHeaders(t, mem, "k")
	if len(got) != 3 || got["Location"] == "" || got["Etag"] == "" || got["Cache-Control"] == "" {
		t.Errorf("stored headers %v, want Location, Etag and Cache-Control", got)
	}
}

// TestStoredHeadersNeverCredentials lists credential headers, the
// framing and the middleware's own headers in Options.StoredHeaders: they
// are never stored, Middleware warns about them, and the other listed
// header (matched without regard to case) is stored.
func TestStoredHeadersNeverCredentials(t *testing.T) {
	var calls atomic.Int32
	mem := NewMemoryStore()
	var logs bytes.Buffer
	opts := Options{
		StoredHeaders: append([]string{"x-custom", "set-cookie", "Content-Length", "Idempotency-Key", "Idempotent-Replayed", RedactedHeader, RetentionHeader},
			credentialNames...),
		Logger: slog.New(slog.NewTextHandler(&logs, nil)),
	}
	ts := mwServer(t, mem, opts, credentialHandler(&calls))
	ts.mustSend(t, keyed("k", "{}"))
	again := ts.mustSend(t, keyed("k", "{}"))
	if again.header.Get("X-Custom") != "mine" || again.header.Get("Location") != "" {
		t.Errorf("replay: X-Custom %q, Location %q; want only the listed X-Custom", again.header.Get("X-Custom"), again.header.Get("Location"))
	}
	for _, h := range append([]string{RedactedHeader}, credentialNames...) {
		if v := again.header.Values(h); v != nil {
			t.Errorf("replayed %s: %q, want none", h, v)
		}
	}
	if got := storedHeaders(t, mem, "k"); len(got) != 1 || got["X-Custom"] != "mine" {
		t.Errorf("stored headers %v, want only X-Custom", got)
	}
	for _, h := range append([]string{"Content-Length", "Idempotency-Key", "Idempotency-Ttl"}, credentialNames...) {
		if !strings.Contains(logs.String(), h) {
			t.Errorf("no warning names %s: %s", h, logs.String())
		}
	}
}

// TestStoredHeadersNone: an empty list stores no header but the content
// type.
func TestStoredHeadersNone(t *testing.T) {
	var calls atomic.Int32
	mem := NewMemoryStore()
	ts := mwServer(t, mem, Options{StoredHeaders: []string{}}, credentialHandler(&calls))
	ts.mustSend(t, keyed("k", "{}"))
	again := ts.mustSend(t, keyed("k", "{}"))
	if again.header.Get("Location") != "" || again.header.Get("Content-Type") != "application/json" || string(again.body) != `{"id":"pay_1"}` {
		t.Errorf("replay %v %q, want the content type and body alone", again.header, again.body)
	}
	if got := storedHeaders(t, mem, "k"); len(got) != 0 {
		t.Errorf("stored headers %v, want none", got)
	}
}

// maskCard is a redaction hook: it masks the card number of the body, and
// tries to change the status and add a cookie and a header that is not
// kept, which the middleware undoes.
func maskCard(r *http.Request, resp StoredResponse) StoredResponse {
	resp.Body = bytes.ReplaceAll(resp.Body, []byte("4242424242424242"), []byte("************4242"))
	resp.Status = http.StatusOK
	resp.Header["set-cookie"] = "planted=1"
	resp.Header["X-Custom"] = "planted"
	resp.Header["etag"] = `"redacted"`
	return resp
}

// TestRedact: the first client gets the whole response; the store holds
// the redacted one, and the replay is it, marked with RedactedHeader,
// with the first status and only the headers StoredHeaders keeps.
func TestRedact(t *testing.T) {
	for _, sealed := range []bool{false, true} {
		t.Run(fmt.Sprintf("sealed=%v", sealed), func(t *testing.T) {
			var calls atomic.Int32
			mem := NewMemoryStore()
			var store Store = mem
			if sealed {
				store = Sealed(mem, testSealKeys(t, "k1"))
			}
			ts := mwServer(t, store, Options{Redact: maskCard}, sealedHandler(&calls))
			first := ts.mustSend(t, keyed("k", "{}"))
			if !bytes.Contains(first.body, []byte("4242424242424242")) || first.header.Get(RedactedHeader) != "" {
				t.Errorf("first response %q %v: want it whole and unmarked", first.body, first.header)
			}
			again := ts.mustSend(t, keyed("k", "{}"))
			want := bytes.ReplaceAll(first.body, []byte("4242424242424242"), []byte("************4242"))
			if !again.replayed() || again.header.Get(RedactedHeader) != "true" || !bytes.Equal(again.body, want) ||
				again.status != http.StatusCreated || again.header.Get("Location") != first.header.Get("Location") {
				t.Errorf("replay %d %v %q, want 201 %q marked redacted", again.status, again.header, again.body, want)
			}
			if again.header.Get("Etag") != `"redacted"` || again.header.Get("Set-Cookie") != "" || again.header.Get("X-Custom") != "" {
				t.Errorf("replayed headers %v: want the redacted ETag, no cookie, no X-Custom", again.header)
			}
			if calls.Load() != 1 {
				t.Errorf("the handler ran %d times", calls.Load())
			}
			at := storedOf(t, mem, "c", "k")
			if sealed {
				if at, _ = testSealKeys(t, "k1").Open("c", "k", operationOf(t, mem, "c", "k"), at); len(at.Body) == 0 || bytes.Contains(at.Body, []byte("4242424242424242")) {
					t.Errorf("the sealed store holds the whole card number")
				}
			} else if bytes.Contains(at.Body, []byte("4242424242424242")) {
				t.Errorf("the store holds the whole card number: %q", at.Body)
			}
		})
	}
}

// TestRedactNothing: a hook that returns what it was given leaves the
// replay unmarked.
func TestRedactNothing(t *testing.T) {
	var calls atomic.Int32
	ts := mwServer(t, NewMemoryStore(), Options{Redact: func(r *http.Request, resp StoredResponse) StoredResponse { return resp }}, sealedHandler(&calls))
	mustReplay(t, ts.mustSend(t, keyed("k", "{}")), ts.mustSend(t, keyed("k", "{}")))
}

// TestRedactAddsHeader: a hook may add a header the policy keeps to a
// response that had none kept (it is given a header map to add to).
func TestRedactAddsHeader(t *testing.T) {
	ts := mwServer(t, NewMemoryStore(), Options{Redact: func(r *http.Request, resp StoredResponse) StoredResponse {
		resp.Header["Link"] = `</v1/payments/pay_1>; rel="self"`
		return resp
	}}, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "ok")
	})
	first := ts.mustSend(t, keyed("k", "{}"))
	again := ts.mustSend(t, keyed("k", "{}"))
	if first.header.Get("Link") != "" || again.header.Get("Link") == "" || again.header.Get(RedactedHeader) != "true" || string(again.body) != "ok" {
		t.Errorf("first %v, replay %v %q: want the Link on the replay only, marked", first.header, again.header, again.body)
	}
}

// TestRedactPanics: a hook that panics fails the completion: the client
// gets 500, nothing is committed, and the key is released for the retry
// of the same request, which runs again under the same operation.
func TestRedactPanics(t *testing.T) {
	var calls atomic.Int32
	var panics atomic.Bool
	panics.Store(true)
	mem := NewMemoryStore()
	var rows journal
	var ops journal
	h := testHandler(t, mem, Options{Redact: func(r *http.Request, resp StoredResponse) StoredResponse {
		if panics.Load() {
			panic("redaction failed")
		}
		return resp
	}}, func(w http.ResponseWriter, r *http.Request) {
		n := calls.Add(1)
		c, _ := ClaimFromContext(r.Context())
		ops.add(c.OperationID)
		mem.Stage(r.Context(), func() error { rows.add(fmt.Sprint(n)); return nil })
		w.WriteHeader(http.StatusCreated)
	})
	if r := serve(t, h, keyed("k", "{}")); r.status != http.StatusInternalServerError || r.problem(t).Type != ProblemInternal {
		t.Errorf("with a panicking hook: %d %q, want 500", r.status, r.body)
	}
	if got := rows.list(); len(got) != 0 {
		t.Errorf("rows %q committed by a failed completion", got)
	}
	panics.Store(false)
	if r := serve(t, h, keyed("k", "{}")); r.status != http.StatusCreated || r.replayed() {
		t.Errorf("the retry: %d replayed=%v, want it run again", r.status, r.replayed())
	}
	if o := ops.list(); len(o) != 2 || o[0] != o[1] || calls.Load() != 2 {
		t.Errorf("operations %q over %d runs, want the same one twice", o, calls.Load())
	}
	if got := rows.list(); len(got) != 1 || got[0] != "2" {
		t.Errorf("rows %q, want the retry's", got)
	}
}

// bigHandler answers 201 with a Location, an ETag, a Content-Language and
// a body of size bytes.
func bigHandler(calls *atomic.Int32, size int) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		w.Header().Set("Location", "/v1/reports/rep_1")
		w.Header().Set("Etag", `"v1"`)
		w.Header().Set("Content-Language", "en")
		w.Header().Set("Content-Type", "text/csv")
		w.WriteHeader(http.StatusCreated)
		w.Write(bytes.Repeat([]byte("x"), size))
	}
}

// TestMaxStoredBody: a response whose body is over the cap is sent whole
// to the first client and never run again: its retries get its status and
// Location, with a ProblemResponseTooLarge body in place of its body and
// without the headers that describe that body, marked redacted. A body at
// the cap, or any with no cap, is stored whole.
func TestMaxStoredBody(t *testing.T) {
	for _, sealed := range []bool{false, true} {
		t.Run(fmt.Sprintf("sealed=%v", sealed), func(t *testing.T) {
			var store Store = NewMemoryStore()
			if sealed {
				store = Sealed(store, testSealKeys(t, "k1"))
			}
			var calls atomic.Int32
			ts := mwServer(t, store, Options{MaxStoredBodyBytes: 1024}, bigHandler(&calls, 1025))
			first := ts.mustSend(t, keyed("k", "{}"))
			if first.status != http.StatusCreated || len(first.body) != 1025 || first.header.Get(RedactedHeader) != "" {
				t.Fatalf("first: %d, %d bytes, %v", first.status, len(first.body), first.header)
			}
			for range 2 {
				again := ts.mustSend(t, keyed("k", "{}"))
				if again.status != http.StatusCreated || !again.replayed() || again.header.Get(RedactedHeader) != "true" ||
					again.header.Get("Location") != "/v1/reports/rep_1" || again.header.Get("Etag") != "" || again.header.Get("Content-Language") != "" ||
					again.header.Get("Content-Length") != fmt.Sprint(len(again.body)) {
					t.Errorf("retry: %d %v, want 201 with the Location, marked, without ETag and Content-Language", again.status, again.header)
				}
				p := again.problem(t)
				if p.Type != ProblemResponseTooLarge || p.Status != http.StatusCreated || !strings.Contains(p.Detail, "1025 bytes") ||
					!strings.Contains(p.Detail, "Location") || p.Instance != "/v1/payments" {
					t.Errorf("retry's problem %+v", p)
				}
			}
			if n := calls.Load(); n != 1 {
				t.Errorf("the handler ran %d times, want once", n)
			}
		})
	}
	for _, tt := range []struct {
		name string
		max  int64
		size int
	}{
		{"at the cap", 1024, 1024},
		{"no cap", -1, 3 << 20},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var calls atomic.Int32
			ts := mwServer(t, NewMemoryStore(), Options{MaxStoredBodyBytes: tt.max}, bigHandler(&calls, tt.size))
			first := ts.mustSend(t, keyed("k", "{}"))
			again := ts.mustSend(t, keyed("k", "{}"))
			if !again.replayed() || !bytes.Equal(again.body, first.body) || again.header.Get("Etag") != `"v1"` || again.header.Get(RedactedHeader) != "" {
				t.Errorf("retry: %d bytes, %v; want the whole response", len(again.body), again.header)
			}
		})
	}
}

// TestMaxStoredBodyDefault: the default cap is 1 MiB.
func TestMaxStoredBodyDefault(t *testing.T) {
	var calls atomic.Int32
	mem := NewMemoryStore()
	h := testHandler(t, mem, Options{}, bigHandler(&calls, DefaultMaxStoredBodyBytes+1))
	if r := serve(t, h, keyed("big", "{}")); r.status != http.StatusCreated {
		t.Fatal(r.status)
	}
	if at := storedOf(t, mem, "c", "big"); at.ContentType != "application/problem+json" || len(at.Body) > 1024 {
		t.Errorf("stored %q, %d bytes: want the too-large problem", at.ContentType, len(at.Body))
	}
	res, err := mem.Claim(context.Background(), ClaimRequest{ClientID: "c", Key: "big", Method: "POST", Path: "/v1/payments",
		Fingerprint: []byte("x")})
	if err != nil || res.Record.Response.Status != http.StatusCreated {
		t.Errorf("stored status: %+v %v", res.Record, err)
	}
}

// TestReplayKeepsObsTextHeader: a handler that echoes a request header
// (a correlation id) whose value holds obs-text bytes, which net/http
// accepts, answers 201. The operation must complete once and be replayed.
func TestReplayKeepsObsTextHeader(t *testing.T) {
	var calls atomic.Int32
	ts := mwServer(t, NewMemoryStore(), Options{}, func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		w.Header().Set("X-Correlation-Id", r.Header.Get("X-Correlation-Id"))
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"call":%d}`, calls.Load())
	})
	send := func() reply {
		req := keyed("k", "{}").request(t, ts.URL)
		req.Header.Set("X-Correlation-Id", "caf\xe9")
		resp, err := ts.client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var b [256]byte
		n, _ := resp.Body.Read(b[:])
		return reply{status: resp.StatusCode, header: resp.Header, body: b[:n]}
	}
	first := send()
	second := send()
	if first.status != http.StatusCreated || second.status != http.StatusCreated || !second.replayed() || calls.Load() != 1 {
		t.Errorf("first %d %s, second %d replayed=%v %s, handler ran %d times; want 201, then its replay, one run",
			first.status, first.body, second.status, second.replayed(), second.body, calls.Load())
	}
}

// TestReplayKeepsSuppressedContentType: a handler that suppresses the
// Content-Type (net/http's documented nil value) gets none on its first
// response; the replay must not get a sniffed one.
func TestReplayKeepsSuppressedContentType(t *testing.T) {
	ts := mwServer(t, NewMemoryStore(), Options{}, func(w http.ResponseWriter, r *http.Request) {
		w.Header()["Content-Type"] = nil
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte("<html>created</html>"))
	})
	first := ts.mustSend(t, keyed("k", "{}"))
	second := ts.mustSend(t, keyed("k", "{}"))
	if !second.replayed() || first.header.Get("Content-Type") != second.header.Get("Content-Type") {
		t.Errorf("Content-Type of first %q, of replay %q (replayed=%v); want the same",
			first.header.Get("Content-Type"), second.header.Get("Content-Type"), second.replayed())
	}
}

// TestUnsendableStatusIsNotStored: a handler that writes a status net/http
// refuses (WriteHeader panics on codes outside 100-999). The recorder must
// not store an outcome that can never be sent.
func TestUnsendableStatusIsNotStored(t *testing.T) {
	for _, code := range []int{0, 42, 1000} {
		t.Run(fmt.Sprint(code), func(t *testing.T) {
			store := NewMemoryStore()
			h := testHandler(t, store, Options{StoreServerErrors: true}, func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(code)
				w.Write([]byte("ok"))
			})
			func() {
				defer func() { recover() }()
				serve(t, h, keyed("k", "{}"))
			}()
			res, err := store.Claim(context.Background(), ClaimRequest{ClientID: "c", Key: "k", Method: "POST", Path: "/v1/payments",
				Fingerprint: mustFingerprint(t, "POST", "/v1/payments", "", "application/json", "{}"), LockTimeout: DefaultLockTimeout})
			if err != nil {
				t.Fatal(err)
			}
			if res.Outcome == Exists && res.Record.Status == StatusCompleted {
				t.Errorf("WriteHeader(%d), which net/http refuses with a panic, stored as the key's outcome %d", code, res.Record.Response.Status)
			}
		})
	}
}
