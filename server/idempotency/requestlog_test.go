package idempotency

import (
	"bytes"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"testing/slogtest"
)

// TestRequestLogKeepsTheHandlerContract runs slog's own conformance test
// on a request's logger, over a JSON handler.
func TestRequestLogKeepsTheHandlerContract(t *testing.T) {
	var buf bytes.Buffer
	slogtest.Run(t, func(*testing.T) slog.Handler {
		buf.Reset()
		return newRequestLog(slog.New(slog.NewJSONHandler(&buf, nil)), "c", "k", "POST", "/v1/payments").Handler()
	}, func(t *testing.T) map[string]any {
		var m map[string]any
		if err := json.Unmarshal(buf.Bytes(), &m); err != nil {
			t.Fatal(err)
		}
		return m
	})
}

// TestRequestLogWritesWhatWithWould checks that a request's logger writes
// what Logger.With with the request's attributes writes, in the same
// order, also under a group and with attributes added on the way.
func TestRequestLogWritesWhatWithWould(t *testing.T) {
	for _, tc := range []struct {
		name string
		use  func(*slog.Logger) *slog.Logger
	}{
		{"plain", func(l *slog.Logger) *slog.Logger { return l }},
		{"with", func(l *slog.Logger) *slog.Logger { return l.With("attempt", 2) }},
		{"group", func(l *slog.Logger) *slog.Logger { return l.WithGroup("g").With("attempt", 2) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got, want bytes.Buffer
			opts := &slog.HandlerOptions{ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
				if a.Key == slog.TimeKey {
					return slog.Attr{}
				}
				return a
			}}
			base := slog.New(slog.NewTextHandler(&want, opts)).WithGroup("server")
			tc.use(base.With("client", "c", "key", "k", "method", "POST", "path", "/p")).Warn("m", "status", 201)
			base = slog.New(slog.NewTextHandler(&got, opts)).WithGroup("server")
			tc.use(newRequestLog(base, "c", "k", "POST", "/p")).Warn("m", "status", 201)
			if got.String() != want.String() {
				t.Errorf("got  %s\nwant %s", got.String(), want.String())
			}
		})
	}
}

// TestKeyedRequestLogsItsAttributes checks that what the middleware logs
// of a keyed request carries its client, key, method and path.
func TestKeyedRequestLogsItsAttributes(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	s := mwServer(t, NewMemoryStore(), Options{Logger: log}, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.WriteHeader(http.StatusCreated)
	})
	if r := s.mustSend(t, keyed("k1", `{"amount":1}`)); r.status != http.StatusCreated {
		t.Fatalf("status %d", r.status)
	}
	for _, want := range []string{`msg="idempotency: outcome stored" client=c key=k1 method=POST path=/v1/payments status=201 operation=`} {
		if !strings.Contains(buf.String(), want) {
			t.Errorf("the log lacks %q:\n%s", want, buf.String())
		}
	}
}
