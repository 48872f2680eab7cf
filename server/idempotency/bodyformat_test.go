package idempotency

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// curlForm is the Content-Type curl -d sends, whatever the data.
const curlForm = "application/x-www-form-urlencoded"

// orderHandler is a JSON API's handler, as the README's service writes it:
// it decodes the body as JSON whatever its Content-Type, refuses a bad one
// with 400 (the key stays free), and answers 201 with a new order id.
func orderHandler(calls *atomic.Int32) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var in struct {
			Item string `json:"item"`
			Qty  int    `json:"qty"`
		}
		if json.NewDecoder(r.Body).Decode(&in) != nil || in.Item == "" {
			http.Error(w, "bad order", http.StatusBadRequest)
			return
		}
		n := calls.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d,"item":%q,"qty":%d}`, n, in.Item, in.Qty)
	}
}

// TestBodyFormatByContentType pins the default, which the two options
// exist for: curl -d declares a form, so a JSON body sent with it is
// read as a form, where "100% wool" is a malformed escape (400) and two
// orders of the same members are two requests (422).
func TestBodyFormatByContentType(t *testing.T) {
	var calls atomic.Int32
	ts := mwServer(t, NewMemoryStore(), Options{}, orderHandler(&calls))

	r := ts.mustSend(t, call{keys: []string{"k1"}, contentType: curlForm, body: `{"item":"100% wool","qty":1}`})
	assert.Equal(t, http.StatusBadRequest, r.status)
	assert.Contains(t, r.problem(t).Detail, "form: invalid URL escape")

	r = ts.mustSend(t, call{keys: []string{"k2"}, contentType: curlForm, body: `{"item":"wool","qty":1}`})
	require.Equal(t, http.StatusCreated, r.status, "%s", r.body)
	r = ts.mustSend(t, call{keys: []string{"k2"}, contentType: curlForm, body: `{"qty":1,"item":"wool"}`})
	assert.Equal(t, http.StatusUnprocessableEntity, r.status, "members reordered, read as a form")
}

// TestBodyFormatAsJSON checks [BodyAsJSON]: every body is fingerprinted as
// JSON whatever its declared type, so curl -d's JSON is accepted, the
// same document is the same request under any Content-Type and any member
// order, and a body that is not JSON (a form, NUL, invalid UTF-8) is
// refused with 400 before the claim, the key left free.
func TestBodyFormatAsJSON(t *testing.T) {
	var calls atomic.Int32
	var events events
	ts := mwServer(t, NewMemoryStore(), Options{BodyFormat: BodyAsJSON, OnEvent: events.add}, orderHandler(&calls))

	// The curl session.
	first := ts.mustSend(t, call{keys: []string{"k1"}, contentType: curlForm, body: `{"item":"100% wool","qty":1}`})
	require.Equal(t, http.StatusCreated, first.status, "%s", first.body)
	for _, c := range []call{
		{contentType: curlForm, body: `{"qty":1,"item":"100% wool"}`},
		{contentType: "application/json", body: `{ "qty": 1, "item": "100% wool" }`},
		{contentType: "text/plain", body: `{"item":"100% wool","qty":1}`},
		{contentType: "application/json\x00", body: `{"item":"100% wool","qty":1}`},
	} {
		c.keys = []string{"k1"}
		r := serve(t, ts.handler, c)
		assert.Equal(t, http.StatusCreated, r.status, "%q %s", c.contentType, c.body)
		assert.True(t, r.replayed(), "%q %s: the same document is the same request", c.contentType, c.body)
	}
	r := ts.mustSend(t, call{keys: []string{"k1"}, contentType: curlForm, body: `{"item":"100% wool","qty":2}`})
	assert.Equal(t, http.StatusUnprocessableEntity, r.status, "another document with the key")
	assert.EqualValues(t, 1, calls.Load())

	// Bodies that are not one JSON document: refused before the claim.
	for _, c := range []call{
		{contentType: curlForm, body: "item=wool&qty=1"},
		{contentType: curlForm, body: "{\"item\":\"wo\x00ol\",\"qty\":1}"},
		{contentType: curlForm, body: "{\"item\":\"caf\xe9\",\"qty\":1}"},
		{contentType: "text/plain", body: "\x00"},
		{contentType: "application/octet-stream", body: "\xff\xfe{}"},
	} {
		c.keys = []string{"k2"}
		r := ts.mustSend(t, c)
		if assert.Equal(t, http.StatusBadRequest, r.status, "%q %q", c.contentType, c.body) {
			p := r.problem(t)
			assert.Equal(t, ProblemInvalidRequest, p.Type)
			assert.Contains(t, p.Detail, "JSON")
		}
	}
	assert.EqualValues(t, 1, calls.Load(), "no refused body reached the handler")
	// k2 is still free: its corrected request runs.
	r = ts.mustSend(t, call{keys: []string{"k2"}, contentType: curlForm, body: `{"item":"wool","qty":1}`})
	assert.Equal(t, http.StatusCreated, r.status)
	assert.False(t, r.replayed())
	assert.Equal(t, 5, events.count(EventRejected))
}

// TestBodyFormatJSONOnly checks [BodyJSONOnly]: a body declared as
// another type than JSON gets 415 [ProblemUnsupportedMediaType] before it
// is read, naming the media type to send, and the key stays free; JSON
// types and no Content-Type at all are accepted, and a JSON body with NUL
// or invalid UTF-8 gets 400.
func TestBodyFormatJSONOnly(t *testing.T) {
	var calls atomic.Int32
	var events events
	ts := mwServer(t, NewMemoryStore(), Options{BodyFormat: BodyJSONOnly, OnEvent: events.add}, orderHandler(&calls))

	for _, method := range []string{http.MethodPost, http.MethodPatch} {
		for _, ct := range []string{curlForm, "text/plain", "multipart/form-data; boundary=x", "application/jsonx", "json"} {
			r := ts.mustSend(t, call{method: method, keys: []string{"k1"}, contentType: ct, body: `{"item":"100% wool","qty":1}`})
			if !assert.Equal(t, http.StatusUnsupportedMediaType, r.status, "%s %q", method, ct) {
				continue
			}
			p := r.problem(t)
			assert.Equal(t, ProblemUnsupportedMediaType, p.Type)
			assert.Contains(t, p.Detail, "Content-Type: application/json")
			assert.Equal(t, "application/json", r.header.Get("Accept-"+strings.ToLower(method[:1])+strings.ToLower(method[1:])))
			assert.Equal(t, "k1", r.header.Get("Idempotency-Key"))
		}
	}
	// A header that is not a media type at all (NUL, invalid UTF-8),
	// served in process since net/http will not send it.
	for _, ct := range []string{"application/json\x00", "application/\xffjson", "application/json;;"} {
		r := serve(t, ts.handler, call{keys: []string{"k1"}, contentType: ct, body: `{"item":"wool","qty":1}`})
		assert.Equal(t, http.StatusUnsupportedMediaType, r.status, "%q", ct)
	}
	// The refusal comes before the body is read: a client that sent only
	// the headers of a 64 KiB body gets it at once, and the connection is
	// closed rather than drained. (A raw connection: an http.Client still
	// writing the body may see the close as a broken pipe first.)
	conn, err := net.Dial("tcp", strings.TrimPrefix(ts.URL, "http://"))
	require.NoError(t, err)
	defer conn.Close()
	_, err = io.WriteString(conn, "POST /v1/payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k1\r\n"+
		"Content-Type: "+curlForm+"\r\nContent-Length: 65536\r\n\r\n")
	require.NoError(t, err)
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(time.Minute)))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusUnsupportedMediaType, resp.StatusCode)
	assert.True(t, resp.Close, "Connection: close")
	assert.Zero(t, calls.Load())

	// NUL and invalid UTF-8 in a JSON body: 400, nothing stored.
	for _, body := range []string{"{\"item\":\"wo\x00ol\",\"qty\":1}", "{\"item\":\"caf\xe9\",\"qty\":1}", "\x00"} {
		r := ts.mustSend(t, call{keys: []string{"k1"}, body: body})
		assert.Equal(t, http.StatusBadRequest, r.status, "%q", body)
		assert.Equal(t, ProblemInvalidRequest, r.problem(t).Type)
	}
	assert.Zero(t, calls.Load())

	// JSON in its accepted forms: k1 was never used, and every form is the
	// same request.
	for i, c := range []call{
		{contentType: "application/json", body: `{"item":"100% wool","qty":1}`},
		{contentType: "application/json; charset=utf-8", body: `{"qty":1,"item":"100% wool"}`},
		{contentType: "Application/JSON", body: `{"qty":1,"item":"100% wool"}`},
		{contentType: "application/merge-patch+json", body: `{"qty":1,"item":"100% wool"}`},
		{body: `{"qty":1,"item":"100% wool"}`}, // no Content-Type: JSON, the package's default
	} {
		c.keys = []string{"k1"}
		req := c.request(t, ts.URL)
		if c.contentType == "" {
			req.Header.Del("Content-Type")
		}
		resp, err = ts.client.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, http.StatusCreated, resp.StatusCode, "%q", c.contentType)
		assert.Equal(t, i > 0, resp.Header.Get("Idempotent-Replayed") == "true", "%q", c.contentType)
	}
	assert.EqualValues(t, 1, calls.Load())
	assert.Equal(t, 17, events.count(EventRejected), "every refusal is an EventRejected")
}

// TestBodyFormatUnknown checks that New refuses a BodyFormat it does not
// know rather than guess, and that Middleware panics with that error.
func TestBodyFormatUnknown(t *testing.T) {
	_, err := New(NewMemoryStore(), Options{BodyFormat: 7})
	assert.EqualError(t, err, "idempotency: Options.BodyFormat 7 is not a format this package knows")
	assert.PanicsWithError(t, "idempotency: Options.BodyFormat 7 is not a format this package knows", func() {
		Middleware(NewMemoryStore(), Options{BodyFormat: 7})
	})
}
