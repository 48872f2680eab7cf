package main

import (
	"errors"
	"fmt"
	"io"
	"net/url"
	"testing"

	"github.com/idemkit/idem"
)

func TestClassify(t *testing.T) {
	// idem.Client returns the Transport's errors inside a *url.Error.
	wrap := func(err error) error { return &url.Error{Op: "Post", URL: "http://x/v1/payments", Err: err} }
	tests := []struct {
		name string
		err  error
		want state
	}{
		{"success", nil, succeeded},
		{"key reused", wrap(&idem.KeyReuseError{Key: "k", Attempts: 1}), failed},
		{"key reused, answering a retry", wrap(&idem.KeyReuseError{Key: "k", Attempts: 2}), pending},
		{"in progress", wrap(&idem.InProgressError{Key: "k"}), pending},
		{"attempts ran out", wrap(&idem.RetryError{Attempts: 3, Err: io.ErrUnexpectedEOF}), pending},
		{"attempt timeout", wrap(&idem.RetryError{Attempts: 3, Err: fmt.Errorf("%w after 1s", idem.ErrAttemptTimeout)}), pending},
		{"budget", wrap(&idem.RetryError{Attempts: 1, Err: fmt.Errorf("%w; last attempt: EOF", idem.ErrBudgetExhausted)}), pending},
		{"503 after the attempts", &idem.APIError{StatusCode: 503}, pending},
		{"502", &idem.APIError{StatusCode: 502}, pending},
		{"409", &idem.APIError{StatusCode: 409}, pending},
		{"429", &idem.APIError{StatusCode: 429}, pending},
		{"400", &idem.APIError{StatusCode: 400}, failed},
		{"402", &idem.APIError{StatusCode: 402}, failed},
		{"single connection error", wrap(errors.New("connection reset by peer")), pending},
	}
	for _, tt := range tests {
		if got := classify(tt.err); got.state != tt.want {
			t.Errorf("%s: classify(%v) = %+v, want state %d", tt.name, tt.err, got, tt.want)
		}
	}
}
