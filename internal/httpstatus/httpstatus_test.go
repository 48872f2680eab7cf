package httpstatus

import "testing"

func TestText(t *testing.T) {
	for code, want := range map[int]string{
		413: "Content Too Large", 414: "URI Too Long", 416: "Range Not Satisfiable",
		422: "Unprocessable Content", 409: "Conflict", 201: "Created", 599: "",
	} {
		if got := Text(code); got != want {
			t.Errorf("Text(%d) = %q, want %q", code, got, want)
		}
	}
}
