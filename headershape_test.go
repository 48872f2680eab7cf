package idem

import (
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"testing"
)

// TestHeaderNamesRememberedFindEverySpelling: one Transport sends headers
// of a few names, each shape twice, so that the second is read from the
// names the first left behind, from several goroutines: a key or
// first-sent header under the canonical spelling or another one is found
// each time, and sent once, the caller's own value.
func TestHeaderNamesRememberedFindEverySpelling(t *testing.T) {
	srv := newServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode([][]string{
			r.Header.Values("Idempotency-Key"), r.Header.Values(DefaultFirstSentHeader),
		})
	}))
	const date = "Tue, 01 Dec 2026 09:00:00 GMT"
	cases := []struct {
		name      string
		header    http.Header
		key, sent string // the values sent; "" for idem's own
	}{
		{"content type", http.Header{"Content-Type": {"application/json"}}, "", ""},
		{"content type respelt", http.Header{"content-type": {"application/json"}}, "", ""},
		{"key respelt", http.Header{"idempotency-key": {"k-respelt"}}, "k-respelt", ""},
		{"key", http.Header{"Content-Type": {"application/json"}, "Idempotency-Key": {"k-canonical"}}, "k-canonical", ""},
		{"key respelt beside content type", http.Header{"Content-Type": {"application/json"}, "IDEMPOTENCY-KEY": {"k-upper"}}, "k-upper", ""},
		{"first sent", http.Header{"Content-Type": {"application/json"}, DefaultFirstSentHeader: {date}}, "", date},
		{"first sent respelt", http.Header{"Content-Type": {"application/json"}, "repeatability-first-sent": {date}}, "", date},
		{"both", http.Header{"Idempotency-Key": {"k-both"}, DefaultFirstSentHeader: {date}}, "k-both", date},
		{"both respelt", http.Header{"idempotency-key": {"k-both-respelt"}, "repeatability-first-sent": {date}}, "k-both-respelt", date},
	}
	tr := newTransport(t, fastPolicy)
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for _, c := range cases {
				for range 2 {
					req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{}`))
					req.Header = c.header
					resp, err := tr.RoundTrip(req)
					if err != nil {
						t.Errorf("%s: %v", c.name, err)
						return
					}
					var got [][]string
					if err := json.NewDecoder(strings.NewReader(readAll(t, resp))).Decode(&got); err != nil {
						t.Errorf("%s: %v", c.name, err)
						return
					}
					if keys := got[0]; len(keys) != 1 || (c.key != "" && keys[0] != c.key) {
						t.Errorf("%s: key lines %q, want one, %q", c.name, keys, c.key)
					}
					if sent := got[1]; len(sent) != 1 || (c.sent != "" && sent[0] != c.sent) {
						t.Errorf("%s: first-sent lines %q, want one, %q", c.name, sent, c.sent)
					}
				}
			}
		})
	}
	wg.Wait()
}
