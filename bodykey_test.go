package idem

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/keyheader"
)

const (
	testField = "idempotency_key"
	testKey   = "key-from-NewKey"
)

// bodyKeyTests is the table of bodies a Transport with KeyBodyField
// testField (and NewKey returning testKey) sends, or refuses. It also seeds
// FuzzInsertKeyField.
var bodyKeyTests = []struct {
	name    string
	body    string
	want    string // the body sent; "" when refused
	wantKey string // the operation's key
	wantErr error
}{
	{"inserted first", `{"amount":4200,"currency":"usd"}`,
		`{"idempotency_key":"key-from-NewKey","amount":4200,"currency":"usd"}`, testKey, nil},
	{"empty object", `{}`, `{"idempotency_key":"key-from-NewKey"}`, testKey, nil},
	{"empty object with space", " \n{ \t}\r\n", " \n{\"idempotency_key\":\"key-from-NewKey\" \t}\r\n", testKey, nil},
	{"odd formatting kept", "\t{\n   \"amount\" :4200 ,\"tags\":[ 1,2 ,{} ],\"x\":1e+2\n\n}  \n",
		"\t{\"idempotency_key\":\"key-from-NewKey\",\n   \"amount\" :4200 ,\"tags\":[ 1,2 ,{} ],\"x\":1e+2\n\n}  \n", testKey, nil},
	{"nested same name ignored", `{"meta":{"idempotency_key":"nested"},"list":[{"idempotency_key":"in-array"}]}`,
		`{"idempotency_key":"key-from-NewKey","meta":{"idempotency_key":"nested"},"list":[{"idempotency_key":"in-array"}]}`, testKey, nil},
	{"name inside a string ignored", `{"note":"\"idempotency_key\":\"x\" }","b":"\\"}`,
		`{"idempotency_key":"key-from-NewKey","note":"\"idempotency_key\":\"x\" }","b":"\\"}`, testKey, nil},
	{"name as a value ignored", `{"a":"idempotency_key"}`, `{"idempotency_key":"key-from-NewKey","a":"idempotency_key"}`, testKey, nil},
	{"case differs: another field", `{"Idempotency_Key":"other"}`,
		`{"idempotency_key":"key-from-NewKey","Idempotency_Key":"other"}`, testKey, nil},
	{"non-ASCII kept", `{"name":"Zoë \u00e9 ✓"}`, `{"idempotency_key":"key-from-NewKey","name":"Zoë \u00e9 ✓"}`, testKey, nil},
	{"caller's field wins", `{"amount":1,"idempotency_key":"caller-key"}`, `{"amount":1,"idempotency_key":"caller-key"}`, "caller-key", nil},
	{"caller's field with spaces", `{ "idempotency_key" : "caller-key" , "a":[] }`, `{ "idempotency_key" : "caller-key" , "a":[] }`, "caller-key", nil},
	{"caller's field after nested one", `{"m":{"idempotency_key":"n"},"idempotency_key":"top"}`, `{"m":{"idempotency_key":"n"},"idempotency_key":"top"}`, "top", nil},
	{"caller's field name escaped", `{"idempotency\u005fkey":"caller-key"}`, `{"idempotency\u005fkey":"caller-key"}`, "caller-key", nil},
	{"caller's value escaped", `{"idempotency_key":"a\u0062c\/d"}`, `{"idempotency_key":"a\u0062c\/d"}`, "abc/d", nil},
	{"caller's value with quote", `{"idempotency_key":"a\"b"}`, `{"idempotency_key":"a\"b"}`, `a"b`, nil},
	{"caller's value empty", `{"idempotency_key":""}`, "", "", keyheader.ErrEmpty},
	{"caller's value with space", `{"idempotency_key":"order 42"}`, "", "", keyheader.ErrInvalid},
	{"caller's value non-ASCII", `{"idempotency_key":"cl\u00e9"}`, "", "", keyheader.ErrInvalid},
	{"caller's value too long", `{"idempotency_key":"` + strings.Repeat("k", MaxKeyLen+1) + `"}`, "", "", keyheader.ErrTooLong},
	{"caller's value a number", `{"idempotency_key":42}`, "", "", ErrKeyBodyField},
	{"caller's value null", `{"idempotency_key":null}`, "", "", ErrKeyBodyField},
	{"caller's value an object", `{"idempotency_key":{"v":"k"}}`, "", "", ErrKeyBodyField},
	{"field named twice", `{"idempotency_key":"a","b":1,"idempotency_key":"a"}`, "", "", ErrKeyBodyField},
	{"field named twice, once escaped", `{"idempotency_key":"a","idempotency\u005fkey":"b"}`, "", "", ErrKeyBodyField},
	{"other names twice kept", `{"a":1,"a":2}`, `{"idempotency_key":"key-from-NewKey","a":1,"a":2}`, testKey, nil},
	{"array", `[{"idempotency_key":"k"}]`, "", "", ErrKeyBodyField},
	{"string", `"{}"`, "", "", ErrKeyBodyField},
	{"number", `42`, "", "", ErrKeyBodyField},
	{"null", `null`, "", "", ErrKeyBodyField},
	{"empty", ``, "", "", ErrKeyBodyField},
	{"only space", " \n", "", "", ErrKeyBodyField},
	{"unterminated", `{"a":1`, "", "", ErrKeyBodyField},
	{"trailing comma", `{"a":1,}`, "", "", ErrKeyBodyField},
	{"two objects", `{}{}`, "", "", ErrKeyBodyField},
	{"form encoded", `amount=4200&currency=usd`, "", "", ErrKeyBodyField},
	{"invalid UTF-8", "{\"a\":\"\xff\"}", "", "", ErrKeyBodyField},
}

// sentBody is a base transport that records the body, key header and
// GetBody of each attempt and answers 201.
type sentBody struct {
	mu      sync.Mutex
	bodies  []string
	headers [][]string
	replays []string // what GetBody gave
	lengths []int64
}

func (s *sentBody) RoundTrip(req *http.Request) (*http.Response, error) {
	b, err := io.ReadAll(req.Body)
	req.Body.Close()
	if err != nil {
		return nil, err
	}
	replay := "<no GetBody>"
	if req.GetBody != nil {
		rc, err := req.GetBody()
		if err != nil {
			return nil, err
		}
		r, _ := io.ReadAll(rc)
		replay = string(r)
	}
	s.mu.Lock()
	s.bodies = append(s.bodies, string(b))
	s.headers = append(s.headers, req.Header.Values(DefaultKeyHeader))
	s.replays = append(s.replays, replay)
	s.lengths = append(s.lengths, req.ContentLength)
	s.mu.Unlock()
	return statusResponse(http.StatusCreated), nil
}

func bodyKeyTransport(base http.RoundTripper) *Transport {
	return &Transport{Base: base, KeyBodyField: testField, NewKey: func() string { return testKey }, Retry: fastPolicy}
}

// bodyOnly hides a reader's type so that http.NewRequest sets no GetBody.
type bodyOnly struct{ io.Reader }

func TestKeyBodyField(t *testing.T) {
	for _, tt := range bodyKeyTests {
		for _, getBody := range []bool{true, false} {
			name := tt.name
			if !getBody {
				name += "/no GetBody"
			}
			t.Run(name, func(t *testing.T) {
				base := &sentBody{}
				tr := bodyKeyTransport(base)
				var key string
				tr.OnAttempt = func(a Attempt) { key = a.Key }
				var r io.Reader = strings.NewReader(tt.body)
				if !getBody {
					r = bodyOnly{r}
				}
				src := &closeTracker{Reader: r}
				req, err := http.NewRequest(http.MethodPost, mockURL, src)
				if err != nil {
					t.Fatal(err)
				}
				if getBody {
					req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(strings.NewReader(tt.body)), nil }
					req.ContentLength = int64(len(tt.body))
				}
				resp, err := tr.RoundTrip(req)
				if !src.closed {
					t.Errorf("the request body was not closed")
				}
				if tt.wantErr != nil {
					if resp != nil || !errors.Is(err, tt.wantErr) {
						t.Fatalf("RoundTrip = %v, %v; want no response and %v", resp, err, tt.wantErr)
					}
					if !strings.HasPrefix(err.Error(), "idem: ") || !strings.Contains(err.Error(), testField) {
						t.Errorf("error %q does not start with idem: and name the field", err)
					}
					if len(base.bodies) != 0 {
						t.Errorf("%d requests sent, want none", len(base.bodies))
					}
					return
				}
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				if len(base.bodies) != 1 {
					t.Fatalf("%d requests sent, want 1", len(base.bodies))
				}
				if got := base.bodies[0]; got != tt.want {
					t.Errorf("body sent:\n%q\nwant:\n%q", got, tt.want)
				}
				if base.lengths[0] != int64(len(tt.want)) {
					t.Errorf("ContentLength = %d, want %d", base.lengths[0], len(tt.want))
				}
				if base.replays[0] != tt.want {
					t.Errorf("GetBody gave %q, want the body sent", base.replays[0])
				}
				if base.headers[0] != nil {
					t.Errorf("key header %q sent; with KeyBodyField and no KeyHeader, want none", base.headers[0])
				}
				if key != tt.wantKey {
					t.Errorf("key = %q, want %q", key, tt.wantKey)
				}
			})
		}
	}
}

// TestKeyBodyFieldRetriesSendIdenticalBytes runs a real server that fails
// the first attempts: every attempt carries the same rewritten body, with
// GetBody set, whether the request had GetBody or not.
func TestKeyBodyFieldRetriesSendIdenticalBytes(t *testing.T) {
	const body = "{\n  \"amount\": 4200,\n  \"meta\": {\"idempotency_key\": \"nested\"}\n}\n"
	for _, getBody := range []bool{true, false} {
		rec := &recorder{script: []int{503, 500, 201}}
		srv := newServer(t, rec)
		tr := newTransport(t, fastPolicy)
		tr.KeyBodyField = testField
		var sent sentBody
		var getBodies int
		base := tr.Base
		tr.Base = roundTripFunc(func(req *http.Request) (*http.Response, error) {
			if req.GetBody != nil {
				getBodies++
				rc, _ := req.GetBody()
				b, _ := io.ReadAll(rc)
				sent.replays = append(sent.replays, string(b))
			}
			return base.RoundTrip(req)
		})
		var r io.Reader = strings.NewReader(body)
		if !getBody {
			r = bodyOnly{r}
		}
		req, err := http.NewRequest(http.MethodPost, srv.URL, r)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := tr.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		reqs := rec.requests()
		if len(reqs) != 3 || getBodies != 3 {
			t.Fatalf("getBody=%t: %d attempts, %d with GetBody; want 3 and 3", getBody, len(reqs), getBodies)
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(reqs[0].body), &m); err != nil {
			t.Fatal(err)
		}
		key, _ := m[testField].(string)
		if want := "{\"idempotency_key\":\"" + key + "\",\n  \"amount\""; !strings.HasPrefix(reqs[0].body, want) || len(key) != 36 {
			t.Fatalf("body %q does not start with a new key: %q", reqs[0].body, want)
		}
		for i, r := range reqs {
			if r.body != reqs[0].body || sent.replays[i] != reqs[0].body || r.key != "" {
				t.Errorf("getBody=%t: attempt %d sent %q (GetBody %q, header %q); want %q and no header",
					getBody, i+1, r.body, sent.replays[i], r.key, reqs[0].body)
			}
		}
	}
}

func TestKeyBodyFieldWithHeader(t *testing.T) {
	tests := []struct {
		name      string
		format    KeyFormat
		header    []string // the request's Idempotency-Key lines
		pinned    string   // WithKey
		body      string
		wantBody  string
		wantLines []string
		wantErr   string
	}{
		{"new key in both", KeyBare, nil, "", `{"a":1}`,
			`{"idempotency_key":"key-from-NewKey","a":1}`, []string{testKey}, ""},
		{"sf-string header, bare body", KeySFString, nil, "", `{}`,
			`{"idempotency_key":"key-from-NewKey"}`, []string{`"` + testKey + `"`}, ""},
		{"pinned key in both", KeyBare, nil, "pinned", `{}`,
			`{"idempotency_key":"pinned"}`, []string{"pinned"}, ""},
		{"request's header into the body", KeyBare, []string{`"from-header"`}, "pinned", `{}`,
			`{"idempotency_key":"from-header"}`, []string{`"from-header"`}, ""},
		{"body's field into the header", KeyBare, nil, "pinned", `{"idempotency_key":"from\"body"}`,
			`{"idempotency_key":"from\"body"}`, []string{`from"body`}, ""},
		{"header and field agree", KeyBare, []string{"same"}, "", `{"idempotency_key":"same"}`,
			`{"idempotency_key":"same"}`, []string{"same"}, ""},
		{"header and field disagree", KeyBare, []string{"one"}, "", `{"idempotency_key":"two"}`,
			"", nil, "hold different keys"},
		{"invalid header", KeyBare, []string{"a", "b"}, "", `{}`,
			"", nil, keyheader.ErrMultiple.Error()},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			base := &sentBody{}
			tr := bodyKeyTransport(base)
			tr.KeyHeader = "idempotency-key"
			tr.KeyFormat = tt.format
			ctx := context.Background()
			if tt.pinned != "" {
				ctx = WithKey(ctx, tt.pinned)
			}
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, mockURL, strings.NewReader(tt.body))
			if tt.header != nil {
				req.Header[DefaultKeyHeader] = tt.header
			}
			resp, err := tr.RoundTrip(req)
			if tt.wantErr != "" {
				if resp != nil || err == nil || !strings.Contains(err.Error(), tt.wantErr) || len(base.bodies) != 0 {
					t.Fatalf("RoundTrip = %v, %v after %d requests; want none and an error with %q", resp, err, len(base.bodies), tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if base.bodies[0] != tt.wantBody || !slices.Equal(base.headers[0], tt.wantLines) {
				t.Errorf("sent body %q, header %q; want %q, %q", base.bodies[0], base.headers[0], tt.wantBody, tt.wantLines)
			}
		})
	}
}

// TestKeyBodyFieldLeavesRequestAlone: the caller's request keeps its
// GetBody, length and header; only its body is read and closed.
func TestKeyBodyFieldLeavesRequestAlone(t *testing.T) {
	base := &sentBody{}
	tr := bodyKeyTransport(base)
	tr.KeyHeader = "Square-Key"
	const body = `{"amount":1}`
	req, _ := http.NewRequest(http.MethodPost, mockURL, strings.NewReader(body))
	getBody := req.GetBody
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	rc, _ := req.GetBody()
	b, _ := io.ReadAll(rc)
	if string(b) != body || req.ContentLength != int64(len(body)) || len(req.Header) != 0 || getBody == nil {
		t.Errorf("request changed: GetBody gives %q, ContentLength %d, header %v", b, req.ContentLength, req.Header)
	}
}

func TestKeyBodyFieldBufferLimit(t *testing.T) {
	const body = `{"amount":4200,"currency":"usd"}`
	for _, limit := range []int64{int64(len(body)), int64(len(body)) - 1, -1} {
		base := &sentBody{}
		tr := bodyKeyTransport(base)
		tr.MaxBufferedBody = limit
		for _, r := range []io.Reader{strings.NewReader(body), bodyOnly{strings.NewReader(body)}} {
			src := &closeTracker{Reader: r}
			req, _ := http.NewRequest(http.MethodPost, mockURL, src)
			resp, err := tr.RoundTrip(req)
			if limit == int64(len(body)) {
				if err != nil {
					t.Fatalf("limit %d: %v", limit, err)
				}
				resp.Body.Close()
				continue
			}
			want := "larger than MaxBufferedBody"
			if limit < 0 {
				want = "MaxBufferedBody is negative"
			}
			if !errors.Is(err, ErrKeyBodyField) || !strings.Contains(err.Error(), want) || !src.closed {
				t.Errorf("limit %d: RoundTrip = %v (body closed: %t); want ErrKeyBodyField saying %q", limit, err, src.closed, want)
			}
		}
		want := 0
		if limit == int64(len(body)) {
			want = 2
		}
		if len(base.bodies) != want {
			t.Errorf("limit %d: %d requests sent, want %d", limit, len(base.bodies), want)
		}
	}
}

// TestKeyBodyFieldUnkeyedMethods: only keyed methods have their bodies
// read; a PUT with any body goes as it is.
func TestKeyBodyFieldUnkeyedMethods(t *testing.T) {
	base := &sentBody{}
	tr := bodyKeyTransport(base)
	for _, method := range []string{http.MethodPut, http.MethodDelete, "REPORT"} {
		req, _ := http.NewRequest(method, mockURL, strings.NewReader("not json"))
		resp, err := tr.RoundTrip(req)
		if err != nil {
			t.Fatalf("%s: %v", method, err)
		}
		resp.Body.Close()
	}
	for i, b := range base.bodies {
		if b != "not json" || base.headers[i] != nil {
			t.Errorf("attempt %d sent %q with header %q, want the body as it was and no key", i+1, b, base.headers[i])
		}
	}
}

func TestKeyBodyFieldNames(t *testing.T) {
	tests := []struct{ field, key, body, want string }{
		{"ClientToken", "tok", `{"Name":"x"}`, `{"ClientToken":"tok","Name":"x"}`},
		{`we"ird\name`, `k"\`, `{}`, `{"we\"ird\\name":"k\"\\"}`},
		{"tab\there\x01", "k", `{}`, `{"tab\u0009here\u0001":"k"}`},
		{"clé ✓", "k", `{"clé ✓":"mine"}`, `{"clé ✓":"mine"}`},
		{"clé ✓", "k", `{"cl\u00e9 \u2713":"mine"}`, `{"cl\u00e9 \u2713":"mine"}`},
	}
	for _, tt := range tests {
		base := &sentBody{}
		tr := &Transport{Base: base, KeyBodyField: tt.field, NewKey: func() string { return tt.key }}
		req, _ := http.NewRequest(http.MethodPost, mockURL, strings.NewReader(tt.body))
		resp, err := tr.RoundTrip(req)
		if err != nil {
			t.Fatalf("field %q: %v", tt.field, err)
		}
		resp.Body.Close()
		if base.bodies[0] != tt.want {
			t.Errorf("field %q: sent %q, want %q", tt.field, base.bodies[0], tt.want)
		}
	}
	tr := &Transport{Base: &sentBody{}, KeyBodyField: "bad\xff"}
	req, _ := http.NewRequest(http.MethodPost, mockURL, strings.NewReader(`{}`))
	if _, err := tr.RoundTrip(req); !errors.Is(err, ErrKeyBodyField) {
		t.Errorf("field name with invalid UTF-8: RoundTrip error = %v, want ErrKeyBodyField", err)
	}
}

// FuzzInsertKeyField checks findField and insertField on any input: a
// body that findField accepts without the field becomes valid JSON whose
// members are the same plus the field holding the key, and whose bytes
// are the old ones with the member inserted after the brace.
func FuzzInsertKeyField(f *testing.F) {
	for _, tt := range bodyKeyTests {
		f.Add([]byte(tt.body), testField, testKey)
	}
	f.Add([]byte(`{"ClientToken":"x","a":{"b":[1,"]}"]}}`), "ClientToken", `k"\`)
	f.Fuzz(func(t *testing.T, body []byte, field, key string) {
		if !utf8.ValidString(field) {
			return // refused before findField
		}
		if keyheader.Validate(key) != nil {
			key = testKey // refused before insertField
		}
		open, raw, err := findField(body, field)
		var before map[string]json.RawMessage
		objErr := json.Unmarshal(body, &before)
		if objErr == nil && before == nil {
			objErr = errors.New("null") // which Unmarshal takes for a nil map
		}
		if err != nil {
			if objErr == nil && !errors.Is(err, errDuplicate) && utf8.Valid(body) {
				t.Fatalf("findField(%q) = %v, but it is a JSON object", body, err)
			}
			return
		}
		if objErr != nil {
			t.Fatalf("findField(%q) accepted a body that is not a JSON object: %v", body, objErr)
		}
		if raw != nil {
			var got, want any
			if json.Unmarshal(raw, &got) != nil || json.Unmarshal(before[field], &want) != nil || !jsonEqual(got, want) {
				t.Fatalf("findField(%q) = %s, the decoder sees %s", body, raw, before[field])
			}
			return
		}
		if _, ok := before[field]; ok {
			t.Fatalf("findField(%q) missed the field", body)
		}
		orig := bytes.Clone(body)
		out := insertField(body, open, field, key)
		var after map[string]json.RawMessage
		if err := json.Unmarshal(out, &after); err != nil {
			t.Fatalf("insertField(%q) = %q, not a JSON object: %v", orig, out, err)
		}
		var got string
		if err := json.Unmarshal(after[field], &got); err != nil || got != key {
			t.Fatalf("insertField(%q) = %q: field holds %q, want %q", orig, out, after[field], key)
		}
		delete(after, field)
		if len(after) != len(before) {
			t.Fatalf("insertField(%q) = %q: members %d, want %d", orig, out, len(after), len(before))
		}
		for k, v := range before {
			if !bytes.Equal(after[k], v) {
				t.Fatalf("insertField(%q) = %q: member %q is %s, want %s", orig, out, k, after[k], v)
			}
		}
		if !bytes.Equal(out[:open+1], orig[:open+1]) || !bytes.HasSuffix(out, orig[open+1:]) {
			t.Fatalf("insertField(%q) = %q: changed bytes around the inserted member", orig, out)
		}
	})
}

func jsonEqual(a, b any) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return bytes.Equal(x, y)
}

// TestKeyBodyFieldDefaultHeader checks that, with KeyBodyField and no
// KeyHeader, an Idempotency-Key the caller put on the request is the
// operation's key, in the body too, as a key header is whenever it is
// read: it no longer goes on the wire beside another key in the body.
// Without one, no key header is sent.
func TestKeyBodyFieldDefaultHeader(t *testing.T) {
	for _, tt := range []struct {
		name      string
		header    []string
		body      string
		wantBody  string
		wantLines []string
		wantErr   string
	}{
		{"no header", nil, `{}`, `{"idempotency_key":"key-from-NewKey"}`, nil, ""},
		{"header into the body", []string{"from-header"}, `{"a":1}`, `{"idempotency_key":"from-header","a":1}`, []string{"from-header"}, ""},
		{"sf-string header", []string{`"from-header"`}, `{}`, `{"idempotency_key":"from-header"}`, []string{`"from-header"`}, ""},
		{"header and field agree", []string{"same"}, `{"idempotency_key":"same"}`, `{"idempotency_key":"same"}`, []string{"same"}, ""},
		{"header and field disagree", []string{"one"}, `{"idempotency_key":"two"}`, "", nil, "hold different keys"},
		{"invalid header", []string{"a", "b"}, `{}`, "", nil, keyheader.ErrMultiple.Error()},
	} {
		t.Run(tt.name, func(t *testing.T) {
			base := &sentBody{}
			tr := bodyKeyTransport(base)
			req, err := http.NewRequestWithContext(WithKey(context.Background(), "pinned"), http.MethodPost, mockURL, strings.NewReader(tt.body))
			require.NoError(t, err)
			if tt.header != nil {
				req.Header[DefaultKeyHeader] = tt.header
			}
			if tt.name == "no header" {
				req = req.WithContext(context.Background())
			}
			resp, err := tr.RoundTrip(req)
			if tt.wantErr != "" {
				require.Error(t, err)
				assert.Contains(t, err.Error(), tt.wantErr)
				assert.Empty(t, base.bodies, "nothing is sent")
				return
			}
			require.NoError(t, err)
			resp.Body.Close()
			require.Len(t, base.bodies, 1)
			assert.Equal(t, tt.wantBody, base.bodies[0])
			assert.Equal(t, tt.wantLines, base.headers[0])
		})
	}
}
