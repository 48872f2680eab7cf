package idempotency

import (
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// sentAt is a keyed call whose operation was first sent at t, on the
// client's clock.
func sentAt(key, body string, t time.Time) (call, http.Header) {
	h := http.Header{}
	h.Set(DefaultFirstSentHeader, t.UTC().Format(http.TimeFormat))
	return keyed(key, body), h
}

// serveWith serves c with extra headers.
func serveWith(t *testing.T, h http.Handler, c call, extra http.Header) reply {
	t.Helper()
	req := c.request(t, "")
	for k, vs := range extra {
		req.Header[k] = vs
	}
	return serveRequest(t, h, req)
}

// TestFirstSentPolicy: a retry whose key was let go of is refused with
// 410, never run again, whether the key is purged or only expired; a key
// that is still there is served whatever the retry's first-sent time; a
// request without the header is served as before. Client and server
// clocks a minute apart either way change none of it.
func TestFirstSentPolicy(t *testing.T) {
	for _, skew := range []time.Duration{0, time.Minute, -time.Minute} {
		t.Run("client clock "+skew.String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				store := NewMemoryStore()
				var runs atomic.Int32
				h := testHandler(t, store, Options{Retention: time.Hour}, func(w http.ResponseWriter, r *http.Request) {
					runs.Add(1)
					w.WriteHeader(http.StatusCreated)
				})
				clientNow := func() time.Time { return time.Now().Add(skew) }

				// An operation first sent now: run once, replayed while kept.
				first := clientNow()
				c, hdr := sentAt("k1", "{}", first)
				r := serveWith(t, h, c, hdr)
				require.Equal(t, http.StatusCreated, r.status, "%s", r.body)
				assert.Equal(t, "3600", r.header.Get(RetentionHeader))
				time.Sleep(59 * time.Minute) // the key is kept an hour after it finished
				assert.True(t, serveWith(t, h, c, hdr).replayed())

				// Expired, still stored: the retry belongs to the expired
				// operation.
				time.Sleep(2 * time.Minute)
				r = serveWith(t, h, c, hdr)
				require.Equal(t, http.StatusGone, r.status, "retry of an expired key: %s", r.body)
				assert.Equal(t, ProblemKeyExpired, r.problem(t).Type)
				assert.Equal(t, "3600", r.header.Get(RetentionHeader))

				// Purged: the retry is older than the key could be kept.
				n, err := store.Purge(t.Context(), 10)
				require.NoError(t, err)
				require.EqualValues(t, 1, n)
				r = serveWith(t, h, c, hdr)
				require.Equal(t, http.StatusGone, r.status, "retry of a purged key: %s", r.body)
				assert.Equal(t, int32(1), runs.Load(), "the operation ran again")

				// The same key for a new operation, first sent now: run.
				c2, hdr2 := sentAt("k1", "{}", clientNow())
				assert.Equal(t, http.StatusCreated, serveWith(t, h, c2, hdr2).status)
				// A request without the header: served as before.
				assert.Equal(t, http.StatusCreated, serve(t, h, keyed("k2", "{}")).status)
				assert.Equal(t, int32(3), runs.Load())
			})
		})
	}
}

// TestFirstSentLiveKeyServed: an operation retried for longer than the
// retention, whose key is still there (it finished late, or was
// released), is served: replayed, or resumed.
func TestFirstSentLiveKeyServed(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var runs atomic.Int32
		h := testHandler(t, NewMemoryStore(), Options{Retention: time.Hour}, func(w http.ResponseWriter, r *http.Request) {
			if runs.Add(1) == 1 {
				w.WriteHeader(http.StatusBadGateway) // released: only this request resumes it
				return
			}
			w.WriteHeader(http.StatusCreated)
		})
		c, hdr := sentAt("k", "{}", time.Now())
		assert.Equal(t, http.StatusBadGateway, serveWith(t, h, c, hdr).status)
		time.Sleep(50 * time.Minute) // released 50 minutes ago, first sent as long
		assert.Equal(t, http.StatusCreated, serveWith(t, h, c, hdr).status)
		time.Sleep(50 * time.Minute) // completed 50 minutes ago, first sent 100
		assert.True(t, serveWith(t, h, c, hdr).replayed())
		assert.Equal(t, int32(2), runs.Load())
	})
}

// TestFirstSentBadHeader: a first-sent time that is not an HTTP-date, sent
// twice, or further in the future than the allowance gets 400 before
// anything is claimed; one within the allowance is served.
func TestFirstSentBadHeader(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var runs atomic.Int32
		h := testHandler(t, NewMemoryStore(), Options{Retention: time.Hour}, func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			w.WriteHeader(http.StatusCreated)
		})
		now := time.Now().UTC()
		for name, values := range map[string][]string{
			"not a date":         {"yesterday"},
			"NUL":                {"Tue, 01 Dec 2026 10:00:00 GMT\x00"},
			"twice":              {now.Format(http.TimeFormat), now.Format(http.TimeFormat)},
			"past the allowance": {now.Add(7 * time.Minute).Format(http.TimeFormat)},
			"invalid UTF-8":      {"\xff\xfe"},
			"far in the future":  {"Fri, 31 Dec 9999 23:59:59 GMT"},
		} {
			r := serveWith(t, h, keyed("k-"+strings.ReplaceAll(name, " ", "-"), "{}"), http.Header{DefaultFirstSentHeader: values})
			if assert.Equal(t, http.StatusBadRequest, r.status, "%s: %s", name, r.body) {
				assert.Contains(t, r.problem(t).Detail, DefaultFirstSentHeader, name)
			}
		}
		assert.Zero(t, runs.Load())
		c, hdr := sentAt("k", "{}", now.Add(5*time.Minute)) // within a tenth of the hour
		assert.Equal(t, http.StatusCreated, serveWith(t, h, c, hdr).status)
	})
}

// TestFirstSentOptions: IgnoreFirstSent and keys that never expire turn
// the policy off (a retry after the purge runs again); a custom header is
// read; a skew of half the retention or more is refused.
func TestFirstSentOptions(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		for _, opts := range []Options{{Retention: time.Hour, IgnoreFirstSent: true}, {Retention: -1}} {
			store := NewMemoryStore()
			h := testHandler(t, store, opts, func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) })
			c, hdr := sentAt("k", "{}", time.Now().Add(-48*time.Hour))
			r := serveWith(t, h, c, hdr)
			assert.Equal(t, http.StatusCreated, r.status, "%+v: %s", opts, r.body)
			assert.Equal(t, opts.Retention < 0, r.header.Get(RetentionHeader) == "", "%+v: %s %q", opts, RetentionHeader, r.header.Get(RetentionHeader))
		}
		h := testHandler(t, NewMemoryStore(), Options{Retention: time.Hour, FirstSentHeader: "X-First-Sent", FirstSentSkew: time.Second},
			func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) })
		r := serveWith(t, h, keyed("k", "{}"), http.Header{"X-First-Sent": {time.Now().Add(-2 * time.Hour).UTC().Format(http.TimeFormat)}})
		assert.Equal(t, http.StatusGone, r.status, "%s", r.body)
		r = serveWith(t, h, keyed("k2", "{}"), http.Header{"X-First-Sent": {time.Now().Add(2 * time.Second).UTC().Format(http.TimeFormat)}})
		assert.Equal(t, http.StatusBadRequest, r.status, "%s", r.body)
	})
	for _, skew := range []time.Duration{30 * time.Minute, time.Hour, -time.Second} {
		assert.Panics(t, func() { Middleware(NewMemoryStore(), Options{Retention: time.Hour, FirstSentSkew: skew}) }, "%v", skew)
	}
	assert.True(t, strings.HasPrefix(ProblemKeyExpired, "https://idemkit.dev/problems/"))
}

// TestFirstSentRefusalSaysWhichRule: a 410 says why it refused: a retry
// first sent longer ago than the retention is told so; one first sent
// seconds ago, whose key an operator expired, is told that its key was
// let go of, not that it is too old.
func TestFirstSentRefusalSaysWhichRule(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := NewMemoryStore()
		h := testHandler(t, store, Options{Retention: time.Hour}, func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusCreated)
		})
		c, hdr := sentAt("k1", "{}", time.Now())
		require.Equal(t, http.StatusCreated, serveWith(t, h, c, hdr).status)
		time.Sleep(2 * time.Second)
		_, err := store.Expire(t.Context(), "c", "k1", false)
		require.NoError(t, err)
		r := serveWith(t, h, c, hdr)
		require.Equal(t, http.StatusGone, r.status, "%s", r.body)
		assert.Contains(t, r.problem(t).Detail, "let go of")
		assert.NotContains(t, r.problem(t).Detail, "longer ago")

		time.Sleep(2 * time.Hour)
		r = serveWith(t, h, c, hdr)
		require.Equal(t, http.StatusGone, r.status, "%s", r.body)
		assert.Contains(t, r.problem(t).Detail, "first sent longer ago than its Idempotency-Key is kept (1h0m0s)")
	})
}

// TestExpiredByOperatorRefusedAfterPurge: a completed key that an
// operator expired, and that the purge ran over, never lets its
// operation's retry run again (a second charge). The purge keeps the
// key until its retention has passed since its operation began, so the
// retry is refused by the key, and after that as first sent longer ago
// than the retention; a new request then claims the key.
func TestExpiredByOperatorRefusedAfterPurge(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store := NewMemoryStore()
		var runs atomic.Int32
		h := testHandler(t, store, Options{Retention: time.Hour}, func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1) // a charge
			w.WriteHeader(http.StatusCreated)
		})
		admin := &Admin{Store: store, Logger: testLogger(t)}
		purge := func() int64 {
			t.Helper()
			n, err := (&Purger{Store: store, Logger: testLogger(t)}).Purge(t.Context())
			require.NoError(t, err)
			return n
		}

		c, hdr := sentAt("k1", `{"amount":1}`, time.Now())
		require.Equal(t, http.StatusCreated, serveWith(t, h, c, hdr).status)
		time.Sleep(10 * time.Minute)
		_, err := admin.Expire(t.Context(), "c", "k1", "INC-1: the client reuses its keys", false)
		require.NoError(t, err)
		assert.Zero(t, purge(), "purged within the operation's retention")
		r := serveWith(t, h, c, hdr)
		require.Equal(t, http.StatusGone, r.status, "retry after the expiry and a purge: %s", r.body)

		time.Sleep(time.Hour) // past the retention since the operation began
		assert.EqualValues(t, 1, purge(), "the expired key, past its operation's retention")
		r = serveWith(t, h, c, hdr)
		require.Equal(t, http.StatusGone, r.status, "retry after the key was purged: %s", r.body)
		assert.Contains(t, r.problem(t).Detail, "first sent longer ago")
		assert.Equal(t, int32(1), runs.Load(), "charges of the operation")

		// A new operation under the key, first sent now.
		c2, hdr2 := sentAt("k1", `{"amount":2}`, time.Now())
		assert.Equal(t, http.StatusCreated, serveWith(t, h, c2, hdr2).status)
		assert.Equal(t, int32(2), runs.Load())
	})
}
