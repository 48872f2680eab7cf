package main

import (
	"bytes"
	"context"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemkit/idem"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// routerFor returns a router from a primary at primaryURL to fallback,
// and the primary's attempts as its Transport reports them.
func routerFor(t *testing.T, primaryURL string, fallback *fakeProvider) (*Router, func() []idem.Attempt) {
	t.Helper()
	base := &http.Transport{}
	t.Cleanup(base.CloseIdleConnections)
	p := NewProvider("primary", primaryURL, base, fast)
	var mu sync.Mutex
	var attempts []idem.Attempt
	p.Client.HTTPClient.Transport.(*idem.Transport).OnAttempt = func(a idem.Attempt) {
		mu.Lock()
		defer mu.Unlock()
		attempts = append(attempts, a)
	}
	r := &Router{Primary: p, Fallback: NewProvider("fallback", fallback.URL(), base, fast), Rounds: 2}
	return r, func() []idem.Attempt {
		mu.Lock()
		defer mu.Unlock()
		return append([]idem.Attempt(nil), attempts...)
	}
}

func providers(t *testing.T) (primary, fallback *fakeProvider) {
	t.Helper()
	primary, fallback = newFakeProvider("primary"), newFakeProvider("fallback")
	t.Cleanup(primary.Close)
	t.Cleanup(fallback.Close)
	return primary, fallback
}

var payment = Payment{Amount: 4200, Currency: "usd", Customer: "cus_123"}

// TestOpenBreakerFailsOverAtOnce: the primary's breaker refuses the
// payment before anything is sent; idem does not retry the refusal, and
// the router sends the payment to the fallback at once, under a new key.
func TestOpenBreakerFailsOverAtOnce(t *testing.T) {
	primary, fallback := providers(t)
	r, attempts := routerFor(t, primary.URL(), fallback)
	r.Primary.Breaker.Open()

	rec, err := r.Pay(context.Background(), payment)
	require.NoError(t, err)
	assert.Equal(t, "fallback", rec.Provider)
	assert.Equal(t, "fallback_pay_1", rec.ID)

	_, requests := primary.made()
	assert.Zero(t, requests, "nothing reached the primary")
	got := attempts()
	require.Len(t, got, 1, "one attempt at the primary, not retried")
	assert.False(t, got[0].Retry)
	assert.ErrorIs(t, got[0].Err, idem.ErrNotSent)
	keys := fallback.seenKeys()
	require.Len(t, keys, 1)
	assert.NotEqual(t, got[0].Key, keys[0], "the fallback gets a key of its own")
}

// TestHalfSentPaymentNeverFailsOver: the primary makes the payment and
// cuts every answer. The outcome is unknown: the router sends the payment
// to the primary again with the same key, and never to the fallback, even
// once the primary's breaker has opened and refuses it (not sent, that
// round; the payment itself stays unknown).
func TestHalfSentPaymentNeverFailsOver(t *testing.T) {
	primary, fallback := providers(t)
	primary.cutting(1 << 30)
	r, attempts := routerFor(t, primary.URL(), fallback)

	rec, err := r.Pay(context.Background(), payment)
	assert.Nil(t, rec)
	var unknown *UnknownError
	require.ErrorAs(t, err, &unknown)
	assert.Equal(t, "primary", unknown.Provider)

	payments, requests := primary.made()
	assert.Equal(t, 1, payments)
	assert.Positive(t, requests)
	for _, k := range primary.seenKeys() {
		assert.Equal(t, unknown.Key, k, "every request to the primary carries the payment's one key")
	}
	assert.True(t, r.Primary.Breaker.IsOpen(), "the breaker opened on the cut answers")
	assert.ErrorIs(t, attempts()[len(attempts())-1].Err, idem.ErrNotSent, "the last round was refused by the breaker")
	fp, fr := fallback.made()
	assert.Zero(t, fp)
	assert.Zero(t, fr, "the fallback never saw the payment")
}

// TestHalfSentPaymentRecovers: the primary cuts two answers; idem retries
// with the same key and the third gets the stored answer.
func TestHalfSentPaymentRecovers(t *testing.T) {
	primary, fallback := providers(t)
	primary.cutting(2)
	r, _ := routerFor(t, primary.URL(), fallback)

	rec, err := r.Pay(context.Background(), payment)
	require.NoError(t, err)
	assert.Equal(t, "primary", rec.Provider)
	assert.Equal(t, "primary_pay_1", rec.ID)
	keys := primary.seenKeys()
	require.Len(t, keys, 3)
	assert.Equal(t, []string{rec.Key, rec.Key, rec.Key}, keys)
	_, fr := fallback.made()
	assert.Zero(t, fr)
}

// TestCutReceiptIsAskedForAgain: the primary makes the payment and
// answers 201 with a chunked body cut mid-way. The payment was made: the
// router asks the primary again with the same key and gets the receipt
// from its replay; the fallback never sees the payment.
func TestCutReceiptIsAskedForAgain(t *testing.T) {
	primary, fallback := providers(t)
	primary.cuttingBodies(1)
	r, _ := routerFor(t, primary.URL(), fallback)

	rec, err := r.Pay(context.Background(), payment)
	require.NoError(t, err)
	assert.Equal(t, "primary", rec.Provider)
	assert.Equal(t, "primary_pay_1", rec.ID)
	keys := primary.seenKeys()
	require.Len(t, keys, 2)
	assert.Equal(t, []string{rec.Key, rec.Key}, keys)
	fp, fr := fallback.made()
	assert.Zero(t, fp)
	assert.Zero(t, fr)
}

// TestEveryReceiptCutIsUnknown: every answer of the primary is a 201 cut
// mid-way: Pay never says "not paid", and never fails over; it returns
// an UnknownError with the key to ask with.
func TestEveryReceiptCutIsUnknown(t *testing.T) {
	primary, fallback := providers(t)
	primary.cuttingBodies(1 << 30)
	r, _ := routerFor(t, primary.URL(), fallback)

	_, err := r.Pay(context.Background(), payment)
	var unknown *UnknownError
	require.ErrorAs(t, err, &unknown)
	assert.Equal(t, "primary", unknown.Provider)
	pp, _ := primary.made()
	assert.Equal(t, 1, pp)
	_, fr := fallback.made()
	assert.Zero(t, fr)
}

// TestPrimaryDown: a primary whose port is closed. failsafe-go's round
// tripper reads the body before sending, but passes the request's context
// on, so idem's wire trace sees that no attempt wrote its headers: the
// payment was not sent, and fails over at once; so does the next, once
// the breaker has opened.
func TestPrimaryDown(t *testing.T) {
	_, fallback := providers(t)
	r, _ := routerFor(t, closedPort(), fallback)

	for range 2 {
		rec, err := r.Pay(context.Background(), payment)
		require.NoError(t, err)
		assert.Equal(t, "fallback", rec.Provider)
	}
	assert.True(t, r.Primary.Breaker.IsOpen(), "the breaker opened on the refused connections")
	fp, _ := fallback.made()
	assert.Equal(t, 2, fp)
}

// TestRun runs the stories of the command.
func TestRun(t *testing.T) {
	var out bytes.Buffer
	require.NoError(t, run(context.Background(), &out))
	for _, want := range []string{
		"2. the primary's circuit breaker is open\n   paid at fallback\n   payments made: primary 0 (0 requests), fallback 1\n",
		"4. the primary makes the payment, then cuts its receipt mid-way\n   paid at primary\n",
		"5. the primary makes the payment, then cuts every answer\n   outcome unknown: kept to send again to primary with key ",
	} {
		assert.Contains(t, out.String(), want)
	}
	assert.False(t, strings.Contains(out.String(), "not paid"), out.String())

}
