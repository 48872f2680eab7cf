package server

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/idemkit/idem/server/idempotency"
)

func TestParseAPIKeys(t *testing.T) {
	for _, tt := range []struct {
		in      string
		want    map[string]string
		wantErr bool
	}{
		{"sk_test_demo:demo", map[string]string{"sk_test_demo": "demo"}, false},
		{" a:x , b:y ,", map[string]string{"a": "x", "b": "y"}, false},
		{"a:x,b:x", map[string]string{"a": "x", "b": "x"}, false},
		{"", nil, true},
		{"a", nil, true},
		{":x", nil, true},
		{"a:", nil, true},
		{"a:x,a:y", nil, true},
	} {
		got, err := ParseAPIKeys(tt.in)
		if (err != nil) != tt.wantErr || len(got) != len(tt.want) {
			t.Errorf("ParseAPIKeys(%q) = %v, %v", tt.in, got, err)
			continue
		}
		for k, v := range tt.want {
			if got[k] != v {
				t.Errorf("ParseAPIKeys(%q)[%q] = %q, want %q", tt.in, k, got[k], v)
			}
		}
	}
}

func TestBearerAuth(t *testing.T) {
	h := BearerAuth(map[string]string{"tok": "acme"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id, _ := idempotency.ClientIDFromContext(r.Context())
		w.Write([]byte(id))
	}))
	for _, tt := range []struct{ header, want string }{
		{"Bearer tok", "acme"},
		{"bearer  tok ", "acme"},
		{"Bearer tok2", ""},
		{"Basic tok", ""},
		{"Bearer", ""},
		{"", ""},
	} {
		req := httptest.NewRequest("GET", "/", nil)
		req.Header.Set("Authorization", tt.header)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		if tt.want == "" {
			if w.Code != http.StatusUnauthorized || w.Header().Get("Content-Type") != "application/problem+json" {
				t.Errorf("%q: %d, want a 401 problem", tt.header, w.Code)
			}
		} else if w.Code != 200 || w.Body.String() != tt.want {
			t.Errorf("%q: %d %q, want client %q", tt.header, w.Code, w.Body, tt.want)
		}
	}
}
