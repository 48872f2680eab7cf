package idem

import (
	"strings"
	"testing"
)

func TestKeyReuseErrorSaysItOnce(t *testing.T) {
	const head = "idem: POST https://api.example.com/v1/payments with idempotency key k-1: the key was used for a different request (a bug in the caller)"
	tests := []struct {
		problem *Problem
		want    string
	}{
		{&Problem{Title: "Idempotency key reused", Detail: "The key was first used with another request body."}, head + ": The key was first used with another request body."},
		{&Problem{Title: "Unprocessable Content"}, head + ": Unprocessable Content"},
		{&Problem{}, head},
		{nil, head},
	}
	for _, tt := range tests {
		err := &KeyReuseError{Key: "k-1", Method: "POST", URL: "https://api.example.com/v1/payments", Problem: tt.problem}
		got := err.Error()
		if got != tt.want {
			t.Errorf("Error() = %q\nwant      %q", got, tt.want)
		}
		if n := strings.Count(strings.ToLower(got), "different request"); n != 1 {
			t.Errorf("Error() = %q says %d times that the key was reused, want once", got, n)
		}
	}
}
