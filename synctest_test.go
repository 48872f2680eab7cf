package idem

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strings"
	"syscall"
	"testing"
	"testing/synctest"
	"time"
)

// The tests in this file run in a synctest bubble: time is fake and moves
// only when every goroutine of the bubble is blocked, so a wait of an hour
// takes no real time and time.Since measures exactly what the Transport
// slept. The base transport is a fake: no network inside the bubble.

// roundTripFunc is a base transport made of a function.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(req *http.Request) (*http.Response, error) { return f(req) }

// answer is one scripted answer of a fakeServer.
type answer func(req *http.Request) (*http.Response, error)

// reply answers code, with the header pairs kv, and the status line as body.
func reply(code int, kv ...string) answer {
	return replyBody(code, "", "", kv...)
}

// replyBody answers code with the given content type and body (the status
// line if body is empty) and the header pairs kv.
func replyBody(code int, contentType, body string, kv ...string) answer {
	return func(req *http.Request) (*http.Response, error) {
		resp := statusResponse(code)
		if body == "" {
			body = resp.Status
		}
		if contentType != "" {
			resp.Header.Set("Content-Type", contentType)
		}
		for i := 0; i+1 < len(kv); i += 2 {
			resp.Header.Set(kv[i], kv[i+1])
		}
		resp.Body = io.NopCloser(strings.NewReader(body))
		resp.ContentLength = int64(len(body))
		resp.Request = req
		return resp, nil
	}
}

// replyDate answers code with a Retry-After of d from now, written as an
// HTTP-date in layout.
func replyDate(code int, layout string, d time.Duration) answer {
	return func(req *http.Request) (*http.Response, error) {
		return reply(code, "Retry-After", time.Now().UTC().Add(d).Format(layout))(req)
	}
}

func fail(err error) answer {
	return func(*http.Request) (*http.Response, error) { return nil, err }
}

// blockUntilDone is a base that never answers: it returns when the
// attempt's context is done, as http.Transport does.
func blockUntilDone(req *http.Request) (*http.Response, error) {
	<-req.Context().Done()
	return nil, req.Context().Err()
}

// fakeServer is a base transport that answers from a script (its last
// answer repeats) and records when each attempt arrived on the bubble's
// clock. It is used by one operation at a time.
type fakeServer struct {
	start  time.Time
	script []answer
	at     []time.Duration
	keys   []string
}

func newFake(script ...answer) *fakeServer {
	return &fakeServer{start: time.Now(), script: script}
}

func (f *fakeServer) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Body != nil {
		_, _ = io.Copy(io.Discard, req.Body)
		req.Body.Close()
	}
	f.at = append(f.at, time.Since(f.start))
	f.keys = append(f.keys, req.Header.Get(DefaultKeyHeader))
	return f.script[min(len(f.at), len(f.script))-1](req)
}

// gaps returns the times between consecutive attempts.
func (f *fakeServer) gaps() []time.Duration {
	var g []time.Duration
	for i := 1; i < len(f.at); i++ {
		g = append(g, f.at[i]-f.at[i-1])
	}
	return g
}

func (f *fakeServer) reset() {
	f.start, f.at, f.keys = time.Now(), nil, nil
}

// fakePost sends one POST operation through tr.
func fakePost(t *testing.T, tr *Transport, ctx context.Context) (*http.Response, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "https://api.example.com/v1/payments", strings.NewReader(`{"amount":4200}`))
	if err != nil {
		t.Fatal(err)
	}
	return tr.RoundTrip(req)
}

// attempts records what OnAttempt reports.
type attempts []Attempt

func (as *attempts) hook(a Attempt) { *as = append(*as, a) }

func equalDurations(a, b []time.Duration) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestSynctestRetryAfterSecondsHonouredExactly(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := newFake(reply(503, "Retry-After", "3"), reply(429, "Retry-After", "7"), reply(408, "Retry-After", "0"), reply(201))
		var as attempts
		tr := &Transport{Base: srv, OnAttempt: as.hook}
		start := time.Now()
		resp, err := fakePost(t, tr, context.Background())
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != 201 {
			t.Fatalf("status = %d, want 201", resp.StatusCode)
		}
		want := []time.Duration{0, 3 * time.Second, 10 * time.Second, 10 * time.Second}
		if !equalDurations(srv.at, want) {
			t.Errorf("attempts at %v, want %v", srv.at, want)
		}
		if got := time.Since(start); got != 10*time.Second {
			t.Errorf("RoundTrip took %v, want 10s", got)
		}
		for i, wait := range []time.Duration{3 * time.Second, 7 * time.Second, 0} {
			if a := as[i]; !a.Retry || a.Wait != wait || a.Reason != "Retry-After" {
				t.Errorf("attempt %d reported %+v, want a retry after %v for Retry-After", i+1, a, wait)
			}
		}
	})
}

func TestSynctestRetryAfterHTTPDateHonouredExactly(t *testing.T) {
	layouts := []struct{ name, layout string }{
		{"IMF-fixdate", http.TimeFormat},
		{"RFC 850", "Monday, 02-Jan-06 15:04:05 GMT"},
		{"asctime", time.ANSIC},
	}
	for _, l := range layouts {
		t.Run(l.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				// The bubble's clock starts on a whole second, so a date
				// (whole seconds) is an exact wait.
				srv := newFake(reply(503, "Retry-After", "2"), replyDate(503, l.layout, 5*time.Second), reply(201))
				resp, err := fakePost(t, &Transport{Base: srv}, context.Background())
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				want := []time.Duration{0, 2 * time.Second, 7 * time.Second}
				if resp.StatusCode != 201 || !equalDurations(srv.at, want) {
					t.Errorf("status %d, attempts at %v; want 201, attempts at %v", resp.StatusCode, srv.at, want)
				}
			})
		})
	}
}

func TestSynctestRetryAfterPastDateRetriesAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := newFake(reply(503, "Retry-After", "Sun, 06 Nov 1994 08:49:37 GMT"), reply(201))
		resp, err := fakePost(t, &Transport{Base: srv}, context.Background())
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if want := []time.Duration{0, 0}; !equalDurations(srv.at, want) {
			t.Errorf("attempts at %v, want %v", srv.at, want)
		}
	})
}

func TestSynctestRetryAfterAboveMaxIntervalHonoured(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := newFake(reply(503, "Retry-After", "20"), reply(201))
		tr := &Transport{Base: srv, Retry: RetryPolicy{MaxInterval: time.Second}}
		resp, err := fakePost(t, tr, context.Background())
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if want := []time.Duration{0, 20 * time.Second}; !equalDurations(srv.at, want) {
			t.Errorf("attempts at %v, want %v: Retry-After is not capped by MaxInterval", srv.at, want)
		}
	})
}

func TestSynctestRetryAfterAboveMaxRetryAfterEndsAtOnce(t *testing.T) {
	tests := []struct {
		name   string
		policy RetryPolicy
		first  answer
	}{
		{"default cap, seconds", RetryPolicy{}, reply(503, "Retry-After", "31")},
		{"default cap, one hour", RetryPolicy{}, reply(429, "Retry-After", "3600")},
		{"default cap, huge", RetryPolicy{}, reply(503, "Retry-After", "99999999999999999999")},
		{"set cap, seconds", RetryPolicy{MaxRetryAfter: 10 * time.Second}, reply(503, "Retry-After", "11")},
		{"set cap, HTTP-date", RetryPolicy{MaxRetryAfter: 10 * time.Second}, replyDate(503, http.TimeFormat, 11*time.Second)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				srv := newFake(tt.first, reply(201))
				var as attempts
				tr := &Transport{Base: srv, Retry: tt.policy, OnAttempt: as.hook}
				start := time.Now()
				resp, err := fakePost(t, tr, context.Background())
				if err != nil {
					t.Fatalf("err = %v, want the response that asked for the long wait", err)
				}
				if elapsed := time.Since(start); elapsed != 0 {
					t.Errorf("RoundTrip took %v, want it to end at once", elapsed)
				}
				if resp.StatusCode == 201 || len(srv.at) != 1 {
					t.Errorf("status %d after %d attempts, want the first answer after 1", resp.StatusCode, len(srv.at))
				}
				if body := readAll(t, resp); body != resp.Status {
					t.Errorf("body = %q, want the response as it came (%q)", body, resp.Status)
				}
				if len(as) != 1 || as[0].Retry || !strings.Contains(as[0].Reason, "exceeds MaxRetryAfter") {
					t.Errorf("reported %+v, want one final attempt that names MaxRetryAfter", as)
				}
			})
		})
	}

	t.Run("at the cap", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			srv := newFake(reply(503, "Retry-After", "30"), reply(201))
			resp, err := fakePost(t, &Transport{Base: srv}, context.Background())
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if want := []time.Duration{0, DefaultMaxRetryAfter}; resp.StatusCode != 201 || !equalDurations(srv.at, want) {
				t.Errorf("status %d, attempts at %v; want 201, attempts at %v", resp.StatusCode, srv.at, want)
			}
		})
	})
}

func TestSynctestWaitPastMaxElapsedTimeEndsAtOnce(t *testing.T) {
	t.Run("Retry-After", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			srv := newFake(reply(503, "Retry-After", "4"))
			var as attempts
			tr := &Transport{Base: srv, Retry: RetryPolicy{MaxAttempts: 10, MaxElapsedTime: 10 * time.Second}, OnAttempt: as.hook}
			start := time.Now()
			resp, err := fakePost(t, tr, context.Background())
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			// At 8s, a wait of 4s would end at 12s, past 10s: the third 503
			// is returned at 8s instead of sleeping.
			if want := []time.Duration{0, 4 * time.Second, 8 * time.Second}; !equalDurations(srv.at, want) {
				t.Errorf("attempts at %v, want %v", srv.at, want)
			}
			if elapsed := time.Since(start); elapsed != 8*time.Second {
				t.Errorf("RoundTrip took %v, want 8s", elapsed)
			}
			if resp.StatusCode != 503 || as[len(as)-1].Reason != "wait would pass MaxElapsedTime" {
				t.Errorf("status %d, last report %+v", resp.StatusCode, as[len(as)-1])
			}
		})
	})

	t.Run("backoff", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			srv := newFake(fail(readErr(syscall.ECONNRESET)))
			// Every computed wait is at least 20s.
			tr := &Transport{Base: srv, Retry: RetryPolicy{InitialInterval: 40 * time.Second, MaxInterval: time.Minute, MaxElapsedTime: 15 * time.Second}}
			start := time.Now()
			_, err := fakePost(t, tr, context.Background())
			if !errors.Is(err, syscall.ECONNRESET) {
				t.Errorf("err = %v, want the attempt's ECONNRESET in the chain", err)
			}
			if elapsed := time.Since(start); elapsed != 0 || len(srv.at) != 1 {
				t.Errorf("RoundTrip took %v and %d attempts, want 1 attempt and no wait", elapsed, len(srv.at))
			}
		})
	})
}

func TestSynctestWaitPastContextDeadlineEndsAtOnce(t *testing.T) {
	tests := []struct {
		name       string
		retryAfter string
		wantAt     []time.Duration
	}{
		{"after some waits", "4", []time.Duration{0, 4 * time.Second, 8 * time.Second}},
		{"first wait", "20", []time.Duration{0}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				srv := newFake(reply(503, "Retry-After", tt.retryAfter))
				var as attempts
				tr := &Transport{Base: srv, Retry: RetryPolicy{MaxAttempts: 10}, OnAttempt: as.hook}
				start := time.Now()
				resp, err := fakePost(t, tr, ctx)
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				if !equalDurations(srv.at, tt.wantAt) {
					t.Errorf("attempts at %v, want %v", srv.at, tt.wantAt)
				}
				if elapsed := time.Since(start); elapsed != tt.wantAt[len(tt.wantAt)-1] {
					t.Errorf("RoundTrip took %v, want it to end at the last attempt", elapsed)
				}
				if last := as[len(as)-1]; last.Retry || last.Reason != "wait would pass the context deadline" {
					t.Errorf("last report %+v", last)
				}
			})
		})
	}
}

// checkWaits runs ops operations against a server that always answers 503
// and checks every wait between attempts: the i-th is within
// [w(1-J), w(1+J)] and at most MaxInterval, where w is InitialInterval ×
// Multiplier^i capped by MaxInterval. It returns the waits, by retry.
func checkWaits(t *testing.T, p RetryPolicy, ops int) [][]time.Duration {
	t.Helper()
	q := p.withDefaults()
	srv := newFake(reply(503))
	var as attempts
	tr := &Transport{Base: srv, Retry: p, DisableBudget: true, OnAttempt: as.hook}
	byRetry := make([][]time.Duration, q.MaxAttempts-1)
	for range ops {
		srv.reset()
		as = nil
		resp, err := fakePost(t, tr, context.Background())
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		gaps := srv.gaps()
		if len(gaps) != q.MaxAttempts-1 {
			t.Fatalf("%d waits, want %d", len(gaps), q.MaxAttempts-1)
		}
		w := float64(q.InitialInterval)
		for i, g := range gaps {
			w = min(w, float64(q.MaxInterval))
			lo := time.Duration(w*(1-q.Jitter)) - 1 // 1ns of float slack
			hi := min(time.Duration(w*(1+q.Jitter))+1, q.MaxInterval)
			if g < lo || g > hi {
				t.Errorf("wait %d = %v, want within [%v, %v]", i+1, g, lo, hi)
			}
			if as[i].Wait != g {
				t.Errorf("wait %d: reported %v, slept %v", i+1, as[i].Wait, g)
			}
			byRetry[i] = append(byRetry[i], g)
			w *= q.Multiplier
		}
	}
	return byRetry
}

func TestSynctestBackoffWaits(t *testing.T) {
	t.Run("grow within small jitter", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			p := RetryPolicy{MaxAttempts: 6, InitialInterval: time.Second, MaxInterval: 5 * time.Second, Multiplier: 2, Jitter: 0.1, MaxElapsedTime: time.Hour}
			byRetry := checkWaits(t, p, 100)
			// With ±10%, the first three waits (1s, 2s, 4s) cannot overlap:
			// each is longer than any before it.
			for i := 1; i < 3; i++ {
				if slices.Max(byRetry[i-1]) >= slices.Min(byRetry[i]) {
					t.Errorf("waits do not grow: retry %d up to %v, retry %d from %v", i, slices.Max(byRetry[i-1]), i+1, slices.Min(byRetry[i]))
				}
			}
		})
	})

	t.Run("defaults", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			byRetry := checkWaits(t, RetryPolicy{}, 100)
			for i, ws := range byRetry {
				if slices.Min(ws) == slices.Max(ws) {
					t.Errorf("retry %d waited %v in all 100 operations: no jitter", i+1, ws[0])
				}
			}
		})
	})

	t.Run("capped by MaxInterval with jitter", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			// 4s ±50% would reach 6s; MaxInterval caps the wait, jitter
			// included.
			byRetry := checkWaits(t, RetryPolicy{MaxAttempts: 5, InitialInterval: 4 * time.Second, MaxInterval: 5 * time.Second, Jitter: 0.5, MaxElapsedTime: time.Hour}, 100)
			// A quarter of first waits fall above 5s before the cap: in
			// 100 operations, some are capped to exactly 5s.
			if got := slices.Max(byRetry[0]); got != 5*time.Second {
				t.Errorf("longest first wait %v, want some capped to exactly 5s", got)
			}
		})
	})

	t.Run("multiplier below 1 does not shrink", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			checkWaits(t, RetryPolicy{MaxAttempts: 5, InitialInterval: time.Second, Multiplier: 0.25, Jitter: 0.1}, 20)
		})
	})
}

// TestSynctestNaNPolicyStillBacksOff shows the effect of the NaN rows of
// TestRetryPolicyWithDefaults on the wire.
func TestSynctestNaNPolicyStillBacksOff(t *testing.T) {
	tests := []struct {
		name   string
		policy RetryPolicy
	}{
		{"NaN jitter", RetryPolicy{MaxAttempts: 3, InitialInterval: time.Second, Jitter: math.NaN()}},
		{"NaN multiplier", RetryPolicy{MaxAttempts: 3, InitialInterval: time.Second, Multiplier: math.NaN()}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var bug string // reported outside the bubble
			synctest.Test(t, func(t *testing.T) {
				srv := newFake(reply(503))
				resp, err := fakePost(t, &Transport{Base: srv, Retry: tt.policy}, context.Background())
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				// Whatever NaN is taken for, a wait is at least
				// InitialInterval × (1 - DefaultJitter).
				for i, g := range srv.gaps() {
					if g < time.Second/2 && bug == "" {
						bug = fmt.Sprintf("regression: %s: wait %d = %v, want at least 500ms; attempts at %v: the backoff computed Duration(NaN), a negative wait, and the retry was sent at once", tt.name, i+1, g, srv.at)
					}
				}
			})
			if bug != "" {
				t.Error(bug)
			}
		})
	}
}

func TestSynctestConflictTimeoutBoundsWaiting(t *testing.T) {
	const problem = `{"type":"https://idemkit.dev/problems/request-in-progress","title":"Request in progress","status":409,"detail":"A request with this key is still being processed."}`

	t.Run("Retry-After", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			srv := newFake(replyBody(409, "application/problem+json", problem, "Retry-After", "3"))
			tr := &Transport{Base: srv, Retry: RetryPolicy{MaxAttempts: 1, ConflictTimeout: 10 * time.Second}}
			start := time.Now()
			_, err := fakePost(t, tr, context.Background())
			var inprog *InProgressError
			if !errors.As(err, &inprog) {
				t.Fatalf("err = %v, want *InProgressError", err)
			}
			// 409s at 0, 3, 6 and 9s; at 9s another 3s would pass 10s.
			if want := []time.Duration{0, 3 * time.Second, 6 * time.Second, 9 * time.Second}; !equalDurations(srv.at, want) {
				t.Errorf("attempts at %v, want %v", srv.at, want)
			}
			if inprog.Polls != 4 || inprog.Waited != 9*time.Second {
				t.Errorf("Polls %d, Waited %v; want 4 and 9s", inprog.Polls, inprog.Waited)
			}
			if elapsed := time.Since(start); elapsed != 9*time.Second {
				t.Errorf("RoundTrip took %v, want 9s", elapsed)
			}
			if inprog.Key == "" || inprog.Key != srv.keys[0] || inprog.Method != "POST" || inprog.URL != "https://api.example.com/v1/payments" {
				t.Errorf("InProgressError = %+v, want the key sent (%s), method and URL", inprog, srv.keys[0])
			}
			if inprog.Problem == nil || inprog.Problem.Detail != "A request with this key is still being processed." {
				t.Errorf("Problem = %+v, want the last 409's problem details", inprog.Problem)
			}
			for i, k := range srv.keys {
				if k != srv.keys[0] {
					t.Errorf("poll %d sent key %q, want %q", i+1, k, srv.keys[0])
				}
			}
			var rerr *RetryError
			if errors.As(err, &rerr) || errors.Is(err, ErrBudgetExhausted) {
				t.Errorf("err = %v: an unknown outcome must be distinct from other failures", err)
			}
		})
	})

	t.Run("backoff", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			srv := newFake(reply(409))
			tr := &Transport{Base: srv, Retry: RetryPolicy{InitialInterval: time.Second, MaxInterval: 2 * time.Second, ConflictTimeout: 10 * time.Second}}
			start := time.Now()
			_, err := fakePost(t, tr, context.Background())
			var inprog *InProgressError
			if !errors.As(err, &inprog) {
				t.Fatalf("err = %v, want *InProgressError", err)
			}
			elapsed := time.Since(start)
			if inprog.Waited > 10*time.Second || inprog.Waited != elapsed {
				t.Errorf("Waited %v (RoundTrip took %v), want the same, within ConflictTimeout 10s", inprog.Waited, elapsed)
			}
			// Waits of at most 2s: the budget is not given up before 8s.
			if inprog.Waited <= 8*time.Second || inprog.Polls != len(srv.at) {
				t.Errorf("Polls %d over %v for %d requests", inprog.Polls, inprog.Waited, len(srv.at))
			}
		})
	})

	t.Run("MaxConflictRetries", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			srv := newFake(reply(409, "Retry-After", "0"))
			_, err := fakePost(t, &Transport{Base: srv, Retry: RetryPolicy{MaxConflictRetries: 5}}, context.Background())
			var inprog *InProgressError
			if !errors.As(err, &inprog) || inprog.Polls != 6 || len(srv.at) != 6 {
				t.Errorf("err = %v after %d requests, want InProgressError after 6 (5 retries)", err, len(srv.at))
			}
		})
	})

	t.Run("does not use attempts", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			srv := newFake(reply(409, "Retry-After", "1"), reply(409, "Retry-After", "1"), reply(503, "Retry-After", "1"), reply(409, "Retry-After", "1"), reply(201))
			resp, err := fakePost(t, &Transport{Base: srv, Retry: RetryPolicy{MaxAttempts: 2}}, context.Background())
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != 201 || len(srv.at) != 5 {
				t.Errorf("status %d after %d requests, want 201 after 5 (three 409s, one 503)", resp.StatusCode, len(srv.at))
			}
		})
	})
}

func TestSynctestContextCanceledDuringLongWait(t *testing.T) {
	tests := []struct {
		name  string
		first answer
	}{
		{"Retry-After", reply(503, "Retry-After", "20")},
		{"409", reply(409, "Retry-After", "20")},
		{"backoff", fail(readErr(syscall.ECONNRESET))},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				srv := newFake(tt.first)
				tr := &Transport{Base: srv, Retry: RetryPolicy{InitialInterval: 20 * time.Second, MaxInterval: 30 * time.Second}}
				time.AfterFunc(1500*time.Millisecond, cancel)
				start := time.Now()
				_, err := fakePost(t, tr, ctx)
				if elapsed := time.Since(start); elapsed != 1500*time.Millisecond {
					t.Errorf("RoundTrip returned after %v, want at the cancellation (1.5s)", elapsed)
				}
				if !errors.Is(err, context.Canceled) {
					t.Errorf("err = %v, want context.Canceled in the chain", err)
				}
				var rerr *RetryError
				var inprog *InProgressError
				switch {
				case tt.name == "409":
					// The operation ended on a 409: its outcome is unknown.
					if !errors.As(err, &inprog) || inprog.Polls != 1 || inprog.Key != srv.keys[0] {
						t.Errorf("err = %#v, want an InProgressError after 1 poll with the key", err)
					}
				case !errors.As(err, &rerr) || rerr.Attempts != 1 || rerr.Key != srv.keys[0]:
					t.Errorf("err = %#v, want a RetryError after 1 attempt with the key", err)
				}
				if len(srv.at) != 1 {
					t.Errorf("%d attempts, want nothing sent after the cancellation", len(srv.at))
				}
			})
		})
	}
}

func TestSynctestContextCanceledDuringAttemptIsNotRetried(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		srv := newFake(blockUntilDone)
		time.AfterFunc(time.Second, cancel)
		_, err := fakePost(t, &Transport{Base: srv}, ctx)
		if !errors.Is(err, context.Canceled) || errors.Is(err, ErrAttemptTimeout) {
			t.Errorf("err = %v, want the caller's context.Canceled", err)
		}
		if len(srv.at) != 1 {
			t.Errorf("%d attempts, want 1", len(srv.at))
		}
	})
}

func TestSynctestAttemptTimeout(t *testing.T) {
	policy := RetryPolicy{AttemptTimeout: 2 * time.Second, InitialInterval: time.Second, Jitter: 0.1}

	t.Run("fires and is retried", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			var blocked time.Duration
			srv := newFake(func(req *http.Request) (*http.Response, error) {
				start := time.Now()
				resp, err := blockUntilDone(req)
				blocked = time.Since(start)
				return resp, err
			}, reply(201))
			var as attempts
			resp, err := fakePost(t, &Transport{Base: srv, Retry: policy, OnAttempt: as.hook}, context.Background())
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if blocked != 2*time.Second {
				t.Errorf("the first attempt was cut after %v, want AttemptTimeout (2s)", blocked)
			}
			if len(srv.at) != 2 || srv.at[1] < 2900*time.Millisecond || srv.at[1] > 3100*time.Millisecond {
				t.Errorf("attempts at %v, want the second at 2s + 1s±10%%", srv.at)
			}
			if e := as[0].Err; !errors.Is(e, ErrAttemptTimeout) || errors.Is(e, context.Canceled) || errors.Is(e, context.DeadlineExceeded) || !as[0].Retry {
				t.Errorf("first attempt reported err %v, retry %t; want ErrAttemptTimeout, distinct from cancellation, retried", e, as[0].Retry)
			}
			if srv.keys[0] == "" || srv.keys[0] != srv.keys[1] {
				t.Errorf("keys %q, want the same key on both attempts", srv.keys)
			}
		})
	})

	t.Run("exhausted", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			srv := newFake(blockUntilDone)
			p := policy
			p.MaxAttempts = 3
			_, err := fakePost(t, &Transport{Base: srv, Retry: p}, context.Background())
			var rerr *RetryError
			if !errors.As(err, &rerr) || rerr.Attempts != 3 || !errors.Is(err, ErrAttemptTimeout) {
				t.Errorf("err = %v, want a RetryError after 3 attempts with ErrAttemptTimeout", err)
			}
			if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("err = %v: an attempt timeout must not look like the caller's cancellation", err)
			}
		})
	})

	t.Run("not fired by a timely answer", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			srv := newFake(func(req *http.Request) (*http.Response, error) {
				time.Sleep(1999 * time.Millisecond)
				return reply(201)(req)
			})
			resp, err := fakePost(t, &Transport{Base: srv, Retry: policy}, context.Background())
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != 201 || len(srv.at) != 1 {
				t.Errorf("status %d after %d attempts, want 201 after 1", resp.StatusCode, len(srv.at))
			}
		})
	})

	t.Run("slow body is not cut", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			var attemptCtx context.Context
			srv := newFake(func(req *http.Request) (*http.Response, error) {
				attemptCtx = req.Context()
				resp, _ := reply(201)(req)
				// Of unknown length: not read inside the attempt (see
				// MaxBufferedResponse and TestSynctestAnswerReadWithinAttemptTimeout).
				resp.Body, resp.ContentLength = io.NopCloser(&slowReader{delay: 5 * time.Second, data: "paid"}), -1
				return resp, nil
			})
			resp, err := fakePost(t, &Transport{Base: srv, Retry: policy}, context.Background())
			if err != nil {
				t.Fatal(err)
			}
			body, err := io.ReadAll(resp.Body)
			if err != nil || string(body) != "paid" {
				t.Errorf("body = %q, %v; want the whole body read over 5s", body, err)
			}
			if attemptCtx.Err() != nil {
				t.Errorf("the attempt's context ended before the body was closed: %v", context.Cause(attemptCtx))
			}
			resp.Body.Close()
			if attemptCtx.Err() == nil {
				t.Errorf("the attempt's context is still live after the body was closed")
			}
		})
	})
}

// slowReader returns data after a delay.
type slowReader struct {
	delay time.Duration
	data  string
}

func (r *slowReader) Read(p []byte) (int, error) {
	if r.data == "" {
		return 0, io.EOF
	}
	time.Sleep(r.delay)
	n := copy(p, r.data)
	r.data = r.data[n:]
	return n, nil
}

// TestSynctestRetryableErrorEndedEarlyIsRetryError checks the documented
// contract: RoundTrip returns "the error of a single attempt that is not
// retryable" as it is, and a *RetryError "when an error that would be
// retried could not be: attempts, time or retry budget ran out".
func TestSynctestRetryableErrorEndedEarlyIsRetryError(t *testing.T) {
	tests := []struct {
		name   string
		policy RetryPolicy
		ctx    func() (context.Context, context.CancelFunc)
	}{
		{"budget", RetryPolicy{}, nil}, // the Transport's budget is emptied first
		{"MaxElapsedTime", RetryPolicy{InitialInterval: 40 * time.Second, MaxInterval: time.Minute, MaxElapsedTime: 15 * time.Second}, nil},
		{"context deadline", RetryPolicy{InitialInterval: 40 * time.Second, MaxInterval: time.Minute}, func() (context.Context, context.CancelFunc) {
			return context.WithTimeout(context.Background(), 15*time.Second)
		}},
		{"MaxAttempts 1", RetryPolicy{MaxAttempts: 1}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var bug string // reported outside the bubble
			synctest.Test(t, func(t *testing.T) {
				ctx, cancel := context.Background(), context.CancelFunc(func() {})
				if tt.ctx != nil {
					ctx, cancel = tt.ctx()
				}
				defer cancel()
				srv := newFake(fail(readErr(syscall.ECONNRESET)))
				tr := &Transport{Base: srv, Retry: tt.policy}
				if tt.name == "budget" {
					tr.Budget = NewRetryBudget(1, 0.1)
					tr.Budget.spend()
				}
				_, err := fakePost(t, tr, ctx)
				if !errors.Is(err, syscall.ECONNRESET) || len(srv.at) != 1 {
					t.Fatalf("err = %v after %d attempts, want ECONNRESET after 1", err, len(srv.at))
				}
				var rerr *RetryError
				if !errors.As(err, &rerr) {
					bug = fmt.Sprintf("regression: a retryable error whose retry is ruled out by %s after 1 attempt comes back bare (%T: %v), not as the documented *RetryError; finish returns a RetryError only when op.attempts > 1, while the budget case (failWith) always does", tt.name, err, err)
					return
				}
				if rerr.Attempts != 1 || rerr.Key != srv.keys[0] {
					t.Errorf("RetryError = %+v, want 1 attempt and the key", rerr)
				}
			})
			if bug != "" {
				t.Error(bug)
			}
		})
	}
}

func TestSynctestResponseAsContextEndsIsNotRetried(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		// The 503 arrives, and the caller gives up before it is handled.
		srv := newFake(func(req *http.Request) (*http.Response, error) {
			cancel()
			return reply(503, "Retry-After", "0")(req)
		}, reply(201))
		budget := NewRetryBudget(1, 0.1)
		resp, err := fakePost(t, &Transport{Base: srv, Budget: budget}, ctx)
		if err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("err = %v, want the response or context.Canceled", err)
		}
		if resp != nil {
			resp.Body.Close()
		}
		if len(srv.at) != 1 || budget.Tokens() != 1 {
			t.Errorf("%d attempts, %v tokens left; want 1 attempt and no retry spent", len(srv.at), budget.Tokens())
		}
	})
}

// TestSynctestConflictCutShortIsInProgress checks that a keyed operation
// that ends on a 409, whatever stops the waiting, ends with an
// InProgressError carrying the key, never with the raw 409.
func TestSynctestConflictCutShortIsInProgress(t *testing.T) {
	tests := []struct {
		name    string
		ra      []string // the Retry-After of each 409
		policy  RetryPolicy
		timeout time.Duration // of the context; 0: none
		cancel  bool          // the context is canceled as the 409 arrives
		wantErr error         // in the chain
	}{
		{"context deadline", []string{"10"}, RetryPolicy{}, 5 * time.Second, false, nil},
		{"MaxElapsedTime", []string{"10"}, RetryPolicy{MaxElapsedTime: 3 * time.Second}, 0, false, nil},
		{"MaxRetryAfter", []string{"1", "60"}, RetryPolicy{ConflictTimeout: time.Hour}, 0, false, nil},
		{"20-digit Retry-After", []string{"1", "99999999999999999999"}, RetryPolicy{}, 0, false, nil},
		{"19-digit Retry-After", []string{"1", "9223372036854775807"}, RetryPolicy{MaxRetryAfter: math.MaxInt64}, 0, false, nil},
		{"context canceled", []string{"1"}, RetryPolicy{}, 0, true, context.Canceled},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				ctx, cancel := context.WithCancel(context.Background())
				if tt.timeout > 0 {
					ctx, cancel = context.WithTimeout(ctx, tt.timeout)
				}
				defer cancel()
				var script []answer
				for _, ra := range tt.ra {
					script = append(script, func(req *http.Request) (*http.Response, error) {
						if tt.cancel {
							cancel()
						}
						return replyBody(409, "application/problem+json", `{"title":"Request in progress"}`, "Retry-After", ra)(req)
					})
				}
				srv := newFake(script...)
				resp, err := fakePost(t, &Transport{Base: srv, Retry: tt.policy}, ctx)
				if resp != nil {
					resp.Body.Close()
				}
				var inprog *InProgressError
				if !errors.As(err, &inprog) {
					t.Fatalf("got %v, %v; want an InProgressError", resp, err)
				}
				if inprog.Key != srv.keys[0] || inprog.Polls != len(tt.ra) || len(srv.at) != len(tt.ra) || inprog.Problem == nil || inprog.Problem.Title != "Request in progress" {
					t.Errorf("InProgressError = %+v after %d requests; want the key %s, %d polls, the problem", inprog, len(srv.at), srv.keys[0], len(tt.ra))
				}
				if tt.wantErr != nil && !errors.Is(err, tt.wantErr) {
					t.Errorf("err = %v, want %v in the chain", err, tt.wantErr)
				}
			})
		})
	}
}

func TestExceedsDoesNotOverflow(t *testing.T) {
	tests := []struct {
		elapsed, wait, limit time.Duration
		want                 bool
	}{
		{0, 5 * time.Second, 10 * time.Second, false},
		{5 * time.Second, 5 * time.Second, 10 * time.Second, false},
		{6 * time.Second, 5 * time.Second, 10 * time.Second, true},
		{time.Second, math.MaxInt64, 10 * time.Second, true},
		{math.MaxInt64 / 2, math.MaxInt64, math.MaxInt64, true},
		{time.Hour, time.Hour, math.MaxInt64, false},
	}
	for _, tt := range tests {
		if got := exceeds(tt.elapsed, tt.wait, tt.limit); got != tt.want {
			t.Errorf("exceeds(%v, %v, %v) = %t, want %t", tt.elapsed, tt.wait, tt.limit, got, tt.want)
		}
	}
}

// TestSynctestGetBodyFailureIsNotAnAttempt checks that an attempt whose
// body cannot be reopened is neither counted nor reported, and that the
// error keeps the outcome of the last attempt sent.
func TestSynctestGetBodyFailureIsNotAnAttempt(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := newFake(fail(readErr(syscall.ECONNRESET)))
		var as attempts
		tr := &Transport{Base: srv, OnAttempt: as.hook}
		req, err := http.NewRequest(http.MethodPost, "https://api.example.com/v1/payments", strings.NewReader(`{"amount":4200}`))
		if err != nil {
			t.Fatal(err)
		}
		reopen := errors.New("the body's file is gone")
		req.GetBody = func() (io.ReadCloser, error) { return nil, reopen }
		_, err = tr.RoundTrip(req)
		var rerr *RetryError
		if !errors.As(err, &rerr) || rerr.Attempts != 1 || rerr.Key != srv.keys[0] {
			t.Fatalf("err = %#v, want a RetryError after the 1 attempt sent, with the key", err)
		}
		if !errors.Is(err, reopen) || !errors.Is(err, syscall.ECONNRESET) {
			t.Errorf("err = %v, want both GetBody's error and the last attempt's in the chain", err)
		}
		if len(as) != 1 || as[0].Number != 1 || len(srv.at) != 1 {
			t.Errorf("OnAttempt saw %d attempts, the server %d; want 1", len(as), len(srv.at))
		}
	})
}

// TestSynctestNotReplayableBody checks that a body that cannot be sent
// again loses the response only when a retry would have been made.
func TestSynctestNotReplayableBody(t *testing.T) {
	tests := []struct {
		name        string
		policy      RetryPolicy
		first       answer
		wantStatus  int   // 0: an error
		wantInChain error // with the error
	}{
		{"MaxAttempts 1", RetryPolicy{MaxAttempts: 1}, reply(503), 503, nil},
		{"Retry-After past MaxRetryAfter", RetryPolicy{}, reply(503, "Retry-After", "3600"), 503, nil},
		{"not retried status", RetryPolicy{}, reply(400), 400, nil},
		{"a retry would be made", RetryPolicy{}, reply(503), 0, ErrBodyNotReplayable},
		{"error with MaxAttempts 1", RetryPolicy{MaxAttempts: 1}, fail(readErr(syscall.ECONNRESET)), 0, syscall.ECONNRESET},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				srv := newFake(tt.first, reply(201))
				req, err := http.NewRequest(http.MethodPost, "https://api.example.com/v1/payments", &onceReader{r: strings.NewReader(`{"amount":4200}`)})
				if err != nil {
					t.Fatal(err)
				}
				resp, err := (&Transport{Base: srv, Retry: tt.policy, MaxBufferedBody: -1}).RoundTrip(req)
				if tt.wantStatus != 0 {
					if err != nil || resp.StatusCode != tt.wantStatus {
						t.Fatalf("got %v, %v; want the %d as it came", resp, err, tt.wantStatus)
					}
					resp.Body.Close()
				} else if !errors.Is(err, tt.wantInChain) {
					t.Errorf("got %v, %v; want an error with %v", resp, err, tt.wantInChain)
				}
				if len(srv.at) != 1 {
					t.Errorf("%d attempts, want 1", len(srv.at))
				}
			})
		})
	}
}

// slowAnswer answers code after d, or fails when the attempt's context
// ends first, as http.Transport does.
func slowAnswer(d time.Duration, code int) answer {
	return func(req *http.Request) (*http.Response, error) {
		select {
		case <-time.After(d):
			return reply(code, "Retry-After", "0")(req)
		case <-req.Context().Done():
			return nil, req.Context().Err()
		}
	}
}

// TestSynctestMaxElapsedTimeBoundsAttempts checks that no attempt waits
// for its response past MaxElapsedTime.
func TestSynctestMaxElapsedTimeBoundsAttempts(t *testing.T) {
	tests := []struct {
		name       string
		policy     RetryPolicy
		script     []answer
		want       time.Duration // RoundTrip's time
		wantStatus int           // 0: a RetryError with the key
		attempts   int
	}{
		{"second attempt cut", RetryPolicy{MaxElapsedTime: 500 * time.Millisecond}, []answer{slowAnswer(400*time.Millisecond, 503)}, 500 * time.Millisecond, 0, 2},
		{"first attempt cut, explicit cap", RetryPolicy{MaxElapsedTime: 500 * time.Millisecond, AttemptTimeout: 2 * time.Second}, []answer{slowAnswer(time.Hour, 201)}, 500 * time.Millisecond, 0, 1},
		{"headers in time", RetryPolicy{MaxElapsedTime: 500 * time.Millisecond}, []answer{slowAnswer(400*time.Millisecond, 503), slowAnswer(50*time.Millisecond, 201)}, 450 * time.Millisecond, 201, 2},
		{"default cap cuts a retry", RetryPolicy{}, []answer{slowAnswer(50*time.Second, 503)}, DefaultMaxElapsedTime, 0, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				srv := newFake(tt.script...)
				start := time.Now()
				resp, err := fakePost(t, &Transport{Base: srv, Retry: tt.policy}, context.Background())
				if elapsed := time.Since(start); elapsed != tt.want {
					t.Errorf("RoundTrip took %v, want %v", elapsed, tt.want)
				}
				if tt.wantStatus != 0 {
					if err != nil || resp.StatusCode != tt.wantStatus {
						t.Fatalf("got %v, %v; want %d", resp, err, tt.wantStatus)
					}
					resp.Body.Close()
					return
				}
				var rerr *RetryError
				if !errors.As(err, &rerr) || rerr.Key != srv.keys[0] || rerr.Attempts != tt.attempts || !errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("err = %v, want a RetryError after %d attempts with the key %s and DeadlineExceeded", err, tt.attempts, srv.keys[0])
				}
				if len(srv.at) != tt.attempts {
					t.Errorf("%d attempts sent, want %d", len(srv.at), tt.attempts)
				}
			})
		})
	}
}

// TestSynctestBufferingHonoursContext checks that buffering a body without
// GetBody stops at the context's deadline, not when the producer is done.
func TestSynctestBufferingHonoursContext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		pr, pw := io.Pipe()
		producer := make(chan struct{})
		defer func() { <-producer }()
		go func() {
			defer close(producer)
			pw.Write([]byte(`{"amount":`))
			time.Sleep(2 * time.Second)
			pw.Write([]byte(`4200}`))
			pw.Close()
		}()
		ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
		defer cancel()
		srv := newFake(reply(201))
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, "https://api.example.com/v1/payments", pr)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		resp, err := (&Transport{Base: srv}).RoundTrip(req)
		if elapsed := time.Since(start); elapsed != 150*time.Millisecond {
			t.Errorf("RoundTrip returned after %v, want at the deadline (150ms)", elapsed)
		}
		if resp != nil {
			resp.Body.Close()
		}
		if !errors.Is(err, context.DeadlineExceeded) || len(srv.at) != 0 {
			t.Errorf("err = %v after %d attempts, want DeadlineExceeded and nothing sent", err, len(srv.at))
		}
	})
}

// TestSynctestContextEndingFirstAttemptKeepsKey checks that when the
// request's context ends a keyed request's first attempt (a deadline while
// the server is slow, a cancellation), the error carries the key: the
// attempt may have been processed, and without its key the caller cannot
// learn its outcome, only send the payment again under a new key. An
// unkeyed request's error comes back as it is.
func TestSynctestContextEndingFirstAttemptKeepsKey(t *testing.T) {
	for _, tt := range []struct {
		name string
		ctx  func() (context.Context, context.CancelFunc)
		want error
	}{
		{"deadline", func() (context.Context, context.CancelFunc) {
			return context.WithTimeout(context.Background(), time.Second)
		}, context.DeadlineExceeded},
		{"cancel", func() (context.Context, context.CancelFunc) {
			ctx, cancel := context.WithCancel(context.Background())
			time.AfterFunc(time.Second, cancel)
			return ctx, cancel
		}, context.Canceled},
	} {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				ctx, cancel := tt.ctx()
				defer cancel()
				srv := newFake(blockUntilDone)
				_, err := fakePost(t, &Transport{Base: srv}, ctx)
				var rerr *RetryError
				if !errors.As(err, &rerr) || rerr.Attempts != 1 || rerr.Key == "" || rerr.Key != srv.keys[0] || !errors.Is(err, tt.want) {
					t.Errorf("err = %T %v, want a RetryError after 1 attempt with the key sent (%q) and %v", err, err, srv.keys[0], tt.want)
				}
				if len(srv.at) != 1 {
					t.Errorf("%d attempts, want 1", len(srv.at))
				}

				ctx, cancel = tt.ctx()
				defer cancel()
				req, _ := http.NewRequestWithContext(ctx, http.MethodPut, "https://api.example.com/v1/things/1", strings.NewReader(`{}`))
				_, err = (&Transport{Base: newFake(blockUntilDone)}).RoundTrip(req)
				if errors.As(err, &rerr) || !errors.Is(err, tt.want) {
					t.Errorf("unkeyed: err = %T %v, want %v as it is", err, err, tt.want)
				}
			})
		})
	}
}

// TestSynctestKeyReuseAfterALostAnswer checks that a 422 to a retry says
// so: the first attempt timed out and may have charged, so the error must
// not read as "nothing happened, a bug" to a caller deciding whether to
// send the payment again under a new key.
func TestSynctestKeyReuseAfterALostAnswer(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := newFake(blockUntilDone, replyBody(422, "application/problem+json", `{"title":"Idempotency key reused"}`))
		_, err := fakePost(t, &Transport{Base: srv, Retry: RetryPolicy{AttemptTimeout: time.Second}}, context.Background())
		var reuse *KeyReuseError
		if !errors.As(err, &reuse) || reuse.Attempts != 2 || reuse.Key != srv.keys[0] {
			t.Fatalf("err = %v, want a KeyReuseError after 2 attempts with the key", err)
		}
		if msg := err.Error(); !strings.Contains(msg, "attempt 2") || !strings.Contains(msg, "may have taken effect") || strings.Contains(msg, "a bug in the caller") {
			t.Errorf("Error() = %q, want it to say that an earlier attempt may have taken effect, not that it is a bug", msg)
		}

		srv = newFake(replyBody(422, "application/problem+json", `{"title":"Idempotency key reused"}`))
		_, err = fakePost(t, &Transport{Base: srv}, context.Background())
		if !errors.As(err, &reuse) || reuse.Attempts != 1 || !strings.Contains(err.Error(), "a bug in the caller") {
			t.Errorf("first attempt: err = %v (Attempts %d), want a KeyReuseError after 1 attempt, a bug in the caller", err, reuse.Attempts)
		}
	})
}
