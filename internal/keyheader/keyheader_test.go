package keyheader

import (
	"errors"
	"strings"
	"testing"

	"github.com/dunglas/httpsfv"
)

var parseTests = []struct {
	name    string
	values  []string
	want    string
	wantErr error
}{
	{"bare uuid", []string{"8e03978e-40d5-43e8-bc93-6894a57f9324"}, "8e03978e-40d5-43e8-bc93-6894a57f9324", nil},
	{"sf-string uuid", []string{`"8e03978e-40d5-43e8-bc93-6894a57f9324"`}, "8e03978e-40d5-43e8-bc93-6894a57f9324", nil},
	{"bare with ows", []string{"  abc\t"}, "abc", nil},
	{"sf-string with escapes", []string{`"a\"b\\c"`}, `a"b\c`, nil},
	{"sf-string with params", []string{`"abc";v=1`}, "", ErrParams},
	{"sf-string with a boolean param", []string{`"abc";v`}, "", ErrParams},
	{"sf-string with two params", []string{`"abc";a=1;b="x"`}, "", ErrParams},
	{"sf-string with params after ows", []string{`"abc";  v=1`}, "", ErrParams},
	{"sf-string, space before params", []string{`"abc" ;v=1`}, "", ErrSyntax},
	{"bare with a semicolon", []string{"abc;v=1"}, "abc;v=1", nil},
	{"bare token-like", []string{"key_123:x"}, "key_123:x", nil},
	{"missing", nil, "", ErrMissing},
	{"two lines", []string{"a", "b"}, "", ErrMultiple},
	{"empty", []string{""}, "", ErrEmpty},
	{"only spaces", []string{"   "}, "", ErrEmpty},
	{"empty sf-string", []string{`""`}, "", ErrEmpty},
	{"space inside bare", []string{"a b"}, "", ErrInvalid},
	{"space inside sf-string", []string{`"a b"`}, "", ErrInvalid},
	{"non-ascii", []string{"clé"}, "", ErrInvalid},
	{"control char", []string{"a\x01b"}, "", ErrInvalid},
	{"unterminated sf-string", []string{`"abc`}, "", ErrSyntax},
	{"sf inner list", []string{`"abc", "def"`}, "", ErrSyntax},
	{"max length", []string{strings.Repeat("k", MaxLen)}, strings.Repeat("k", MaxLen), nil},
	{"too long", []string{strings.Repeat("k", MaxLen+1)}, "", ErrTooLong},
	{"too long sf-string", []string{`"` + strings.Repeat("k", MaxLen+1) + `"`}, "", ErrTooLong},
}

func TestParse(t *testing.T) {
	for _, tt := range parseTests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse(tt.values)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("Parse(%q) error = %v, want %v", tt.values, err, tt.wantErr)
			}
			if got != tt.want {
				t.Errorf("Parse(%q) = %q, want %q", tt.values, got, tt.want)
			}
		})
	}
}

// TestErrParams checks that ErrParams is also an ErrSyntax, so a caller
// that knows only ErrSyntax still classifies it, and no other sentinel.
func TestErrParams(t *testing.T) {
	if !errors.Is(ErrParams, ErrSyntax) || !errors.Is(ErrParams, ErrParams) {
		t.Error("ErrParams is not both ErrParams and ErrSyntax")
	}
	for _, other := range []error{ErrMissing, ErrMultiple, ErrEmpty, ErrTooLong, ErrInvalid} {
		if errors.Is(ErrParams, other) {
			t.Errorf("ErrParams is %v", other)
		}
	}
	if errors.Is(ErrSyntax, ErrParams) {
		t.Error("ErrSyntax is ErrParams")
	}
}

func TestFormatRoundTrip(t *testing.T) {
	for _, key := range []string{"abc", "8e03978e-40d5-43e8-bc93-6894a57f9324", `a"b\c`, "~!#"} {
		for _, sf := range []bool{false, true} {
			v := Format(key, sf)
			got, err := Parse([]string{v})
			if err != nil || got != key {
				t.Errorf("Parse(Format(%q, %v) = %q) = %q, %v; want the key back", key, sf, v, got, err)
			}
		}
	}
	// The sf-string form is what a structured-field library writes.
	want, err := httpsfv.Marshal(httpsfv.NewItem(`a"b\c`))
	if err != nil {
		t.Fatal(err)
	}
	if got := Format(`a"b\c`, true); got != want {
		t.Errorf("Format sf-string = %s, want %s", got, want)
	}
}

func FuzzParse(f *testing.F) {
	for _, tt := range parseTests {
		if len(tt.values) == 1 {
			f.Add(tt.values[0])
		}
	}
	f.Fuzz(func(t *testing.T, v string) {
		key, err := Parse([]string{v})
		if err != nil {
			return
		}
		if Validate(key) != nil {
			t.Fatalf("Parse(%q) returned invalid key %q", v, key)
		}
		// An accepted sf-string is exactly what Format writes: nothing in
		// the header (a parameter, say) was dropped from the key.
		if sf := strings.Trim(v, " \t"); strings.HasPrefix(sf, `"`) && Format(key, true) != sf {
			t.Fatalf("Parse(%q) = %q, which formats as %q: part of the header is not in the key", v, key, Format(key, true))
		}
		// Whatever was accepted formats and parses back to itself, both ways.
		for _, sf := range []bool{false, true} {
			if got, err := Parse([]string{Format(key, sf)}); err != nil || got != key {
				t.Fatalf("round trip of %q (sf=%v) = %q, %v", key, sf, got, err)
			}
		}
	})
}
