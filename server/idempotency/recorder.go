package idempotency

import (
	"bytes"
	"fmt"
	"net/http"
	"strconv"
	"strings"
)

// recorder buffers the response of a handler so the middleware can decide,
// from its status, whether to store it before anything reaches the client.
type recorder struct {
	header      http.Header
	status      int
	body        bytes.Buffer
	wroteHeader bool
	// length backs the Content-Length that writeRecorded sets.
	length [1]string
}

func newRecorder() *recorder { return &recorder{header: make(http.Header)} }

func (rec *recorder) Header() http.Header { return rec.header }

func (rec *recorder) WriteHeader(code int) {
	if rec.wroteHeader {
		return
	}
	// As net/http does: a code it cannot send is the handler's bug, a
	// panic, and never an outcome stored and replayed (a 0 taken for a
	// 200, a 1000 that every replay would fail to send).
	if code < 100 || code > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", code))
	}
	if code < 200 { // 1xx responses are not buffered
		return
	}
	rec.status, rec.wroteHeader = code, true
}

func (rec *recorder) Write(p []byte) (int, error) {
	if !rec.wroteHeader {
		rec.WriteHeader(http.StatusOK)
	}
	return rec.body.Write(p)
}

// result returns the status, defaulting to 200 for a handler that wrote
// nothing, and fixes the Content-Type the way net/http would have sniffed
// it, so the first response and its replays carry the same one.
func (rec *recorder) result() int {
	if !rec.wroteHeader {
		rec.status = http.StatusOK
	}
	if _, ok := rec.header["Content-Type"]; !ok && rec.body.Len() > 0 {
		rec.header.Set("Content-Type", http.DetectContentType(rec.body.Bytes()))
	}
	return rec.status
}

// stored returns the response as it is kept for replays, with the headers
// keeps reports true for (see [Options.StoredHeaders]), and the names of
// the headers it leaves out because a store cannot keep them: a value (or
// name) that is not valid UTF-8 or holds a NUL ([ValidText]), such as a
// request header echoed with obs-text bytes, which net/http accepts. The
// stores refuse such text, and failing the completion over a header would
// fail the operation on every retry, after its work was done; so the first
// response carries the header and its replays do not.
func (rec *recorder) stored(keeps func(name string) bool) (resp StoredResponse, dropped []string) {
	resp = StoredResponse{
		Status:      rec.status,
		ContentType: rec.header.Get("Content-Type"),
		Body:        rec.body.Bytes(), // no one writes to it any more
	}
	if !ValidText(resp.ContentType) {
		resp.ContentType = ""
		dropped = append(dropped, "Content-Type")
	}
	for name, values := range rec.header {
		if !keeps(name) || len(values) == 0 {
			continue
		}
		value := strings.Join(values, ", ")
		if !ValidText(name) || !ValidText(value) {
			dropped = append(dropped, name)
			continue
		}
		if resp.Header == nil {
			resp.Header = make(map[string]string)
		}
		resp.Header[name] = value
	}
	return resp, dropped
}

// writeRecorded sends the buffered response to w.
func writeRecorded(w http.ResponseWriter, rec *recorder) {
	h := w.Header()
	for name, values := range rec.header {
		h[name] = values
	}
	if bodyAllowed(rec.status) {
		rec.length[0] = strconv.Itoa(rec.body.Len())
		h["Content-Length"] = rec.length[:]
	}
	w.WriteHeader(rec.status)
	w.Write(rec.body.Bytes())
}

// writeStored replays a stored response to w, byte for byte, with the
// stored headers p replays (see [keepPolicy.replays]): whatever the row
// holds, a replay writes no credential, no framing header and no key
// header, which w carries already as the request sent it.
func writeStored(w http.ResponseWriter, resp *StoredResponse, p *keepPolicy) {
	// The values are set as Header.Set would, in one allocation.
	h := headerSetter{h: w.Header(), values: make([]string, 0, len(resp.Header)+3)}
	for name, value := range resp.Header {
		if p.replays(name) {
			h.set(http.CanonicalHeaderKey(name), value)
		}
	}
	if resp.ContentType != "" {
		h.set("Content-Type", resp.ContentType)
	} else if len(resp.Body) > 0 {
		// The recorder gives every body a Content-Type unless the handler
		// suppressed it (net/http's nil value): suppress it again, or
		// net/http would sniff one the first response did not have.
		h.h["Content-Type"] = nil
	}
	if bodyAllowed(resp.Status) {
		h.set("Content-Length", strconv.Itoa(len(resp.Body)))
	}
	h.set("Idempotent-Replayed", "true")
	w.WriteHeader(resp.Status)
	w.Write(resp.Body)
}

// headerSetter sets header values, each in its own slice of values, which
// it grows only past its capacity.
type headerSetter struct {
	h      http.Header
	values []string
}

// set sets name, which is canonical, to value.
func (s *headerSetter) set(name, value string) {
	s.values = append(s.values, value)
	n := len(s.values)
	s.h[name] = s.values[n-1 : n : n]
}

// bodyAllowed reports whether a response with this status has a body.
func bodyAllowed(status int) bool {
	return status != http.StatusNoContent && status != http.StatusNotModified
}
