package idem

import (
	"context"
	"errors"
	"net/http"
	"syscall"
	"testing"
	"testing/synctest"
	"time"
)

func TestSynctestClassify(t *testing.T) {
	// on returns v for an answer of status code, or for an error if code
	// is 0, and VerdictDefault otherwise.
	on := func(code int, v Verdict) func(*http.Response, error) Verdict {
		return func(resp *http.Response, err error) Verdict {
			if (resp != nil && resp.StatusCode == code) || (err != nil && code == 0) {
				return v
			}
			return VerdictDefault
		}
	}
	tests := []struct {
		name     string
		method   string
		classify func(*http.Response, error) Verdict
		script   []answer
		policy   RetryPolicy
		requests int
		check    func(t *testing.T, resp *http.Response, err error)
	}{
		{"retry a 400", http.MethodPost, on(400, VerdictRetry), []answer{reply(400), reply(201)}, RetryPolicy{}, 2, wantStatus(201)},
		{"retry spends MaxAttempts", http.MethodPost, on(400, VerdictRetry), []answer{reply(400)}, RetryPolicy{MaxAttempts: 3}, 3, wantStatus(400)},
		{"stop a 503", http.MethodPost, on(503, VerdictStop), []answer{reply(503), reply(201)}, RetryPolicy{}, 1, wantStatus(503)},
		{"stop an error", http.MethodPost, on(0, VerdictStop), []answer{fail(readErr(syscall.ECONNRESET)), reply(201)}, RetryPolicy{}, 1, func(t *testing.T, _ *http.Response, err error) {
			var rerr *RetryError
			if !errors.Is(err, syscall.ECONNRESET) || !errors.As(err, &rerr) || rerr.Attempts != 1 || rerr.Key == "" {
				t.Errorf("err = %v, want the single attempt's error in a RetryError with the key", err)
			}
		}},
		{"conflict on a 425", http.MethodPost, on(425, VerdictConflict), []answer{reply(425, "Retry-After", "1")}, RetryPolicy{MaxConflictRetries: 2}, 3, func(t *testing.T, _ *http.Response, err error) {
			var inprog *InProgressError
			if !errors.As(err, &inprog) || inprog.Polls != 3 {
				t.Errorf("err = %v, want an InProgressError after 3 polls", err)
			}
		}},
		{"key reuse on a 400", http.MethodPost, on(400, VerdictKeyReuse), []answer{replyBody(400, "application/problem+json", `{"detail":"another body"}`)}, RetryPolicy{}, 1, func(t *testing.T, _ *http.Response, err error) {
			var reuse *KeyReuseError
			if !errors.As(err, &reuse) || reuse.Problem.Detail != "another body" {
				t.Errorf("err = %v, want a KeyReuseError with the problem", err)
			}
		}},
		{"conflict unkeyed is retry", http.MethodGet, on(409, VerdictConflict), []answer{reply(409), reply(200)}, RetryPolicy{}, 2, wantStatus(200)},
		{"key reuse unkeyed is stop", http.MethodGet, on(400, VerdictKeyReuse), []answer{reply(400), reply(200)}, RetryPolicy{}, 1, wantStatus(400)},
		{"default keeps the table", http.MethodPost, on(503, VerdictDefault), []answer{reply(503), reply(201)}, RetryPolicy{}, 2, wantStatus(201)},
		{"a method not retried stays so", http.MethodConnect, on(503, VerdictRetry), []answer{reply(503), reply(201)}, RetryPolicy{}, 1, wantStatus(503)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				srv := newFake(tt.script...)
				var seen int
				classify := func(resp *http.Response, err error) Verdict {
					seen++
					if (resp == nil) == (err == nil) {
						t.Errorf("Classify(%v, %v): want exactly one of response and error", resp, err)
					}
					return tt.classify(resp, err)
				}
				tr := &Transport{Base: srv, Retry: tt.policy, Classify: classify}
				req, err := http.NewRequest(tt.method, "https://api.example.com/v1/payments", nil)
				if err != nil {
					t.Fatal(err)
				}
				resp, err := tr.RoundTrip(req)
				if resp != nil {
					defer resp.Body.Close()
				}
				if len(srv.at) != tt.requests || seen != tt.requests {
					t.Errorf("%d requests sent, %d classified; want %d", len(srv.at), seen, tt.requests)
				}
				tt.check(t, resp, err)
			})
		})
	}
}

func wantStatus(code int) func(t *testing.T, resp *http.Response, err error) {
	return func(t *testing.T, resp *http.Response, err error) {
		t.Helper()
		if err != nil || resp.StatusCode != code {
			t.Errorf("got %v, %v; want %d", resp, err, code)
		}
	}
}

// TestSynctestClassifyRetryStopsWithTheContext checks that a classifier
// cannot make the Transport send once the context is done.
func TestSynctestClassifyRetryStopsWithTheContext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		srv := newFake(reply(400, "Retry-After", "2"))
		tr := &Transport{Base: srv, Classify: func(*http.Response, error) Verdict { return VerdictRetry }}
		resp, err := fakePost(t, tr, ctx)
		if resp != nil {
			resp.Body.Close()
		}
		if len(srv.at) != 2 {
			t.Errorf("%d requests, want 2 (at 0s and 2s; the next wait passes the deadline)", len(srv.at))
		}
		if err != nil || resp.StatusCode != 400 {
			t.Errorf("got %v, %v; want the last 400, as when the table says retry", resp, err)
		}
	})
}
