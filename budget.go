package idem

import (
	"math"
	"sync/atomic"
)

// Defaults of [RetryBudget], used by [NewRetryBudget] for zero arguments and
// by a [Transport] whose Budget is nil.
const (
	// DefaultBudgetCapacity is the number of retries a full budget allows
	// in a row: of the order of the AWS SDK's standard retry quota (500
	// tokens, 5 to 14 spent a retry), generous for one process, yet an
	// outage drains it within seconds at a few hundred calls a second.
	DefaultBudgetCapacity = 100
	// DefaultBudgetRatio is the share of a retry that each success earns
	// back, as gRPC's retry throttling token ratio: in the long run,
	// retries stay below about a tenth of successful calls.
	DefaultBudgetRatio = 0.1
)

// A RetryBudget limits retries across all the operations that share it,
// so that an outage does not turn every client into a retry storm: each
// retry spends a token, each successful operation earns back a fraction of
// one, and when no whole token is left operations fail fast with
// [ErrBudgetExhausted] instead of retrying. Waits on 409 Conflict spend
// nothing. It follows gRPC's retry throttling and Envoy's retry budgets.
//
// A RetryBudget is safe for concurrent use. Share one between Transports
// to budget them together.
type RetryBudget struct {
	// Tokens are kept in millionths, so that a fractional earning needs
	// no lock: a compare-and-swap loop updates them. capacity and earn
	// are at most maxBudgetCapacity tokens, so their sum fits an int64.
	micro    atomic.Int64
	capacity int64
	earn     int64
}

// token is one token in the budget's unit.
const token = 1_000_000

// maxBudgetCapacity is the largest capacity a RetryBudget keeps, about
// 4.6e12 tokens: a larger one is taken as this.
const maxBudgetCapacity = math.MaxInt64 / 2 / token

// NewRetryBudget returns a full budget of capacity retries, of which each
// successful operation earns back ratio.
//
// A capacity of zero or less takes DefaultBudgetCapacity, and one above
// about 4.6e12 is taken as that. A ratio that is not a positive number
// (zero, negative or NaN) takes DefaultBudgetRatio; ratio is kept to the
// nearest millionth of a token, and at least one millionth; a ratio of
// the capacity or more (+Inf included) refills the budget on every
// success.
func NewRetryBudget(capacity int, ratio float64) *RetryBudget {
	if capacity <= 0 {
		capacity = DefaultBudgetCapacity
	}
	if !(ratio > 0) { // zero, negative, or NaN
		ratio = DefaultBudgetRatio
	}
	b := &RetryBudget{capacity: int64(min(capacity, maxBudgetCapacity)) * token}
	if earn := ratio * token; earn >= float64(b.capacity) { // +Inf included
		b.earn = b.capacity
	} else {
		b.earn = max(int64(math.Round(earn)), 1)
	}
	b.micro.Store(b.capacity)
	return b
}

// Tokens returns the number of retries the budget allows now.
func (b *RetryBudget) Tokens() float64 {
	return float64(b.micro.Load()) / token
}

// spend takes one token and reports whether there was one.
func (b *RetryBudget) spend() bool {
	for {
		cur := b.micro.Load()
		if cur < token {
			return false
		}
		if b.micro.CompareAndSwap(cur, cur-token) {
			return true
		}
	}
}

// succeed earns back the ratio of a token, up to the capacity.
func (b *RetryBudget) succeed() {
	for {
		cur := b.micro.Load()
		if cur >= b.capacity {
			return
		}
		if b.micro.CompareAndSwap(cur, min(cur+b.earn, b.capacity)) {
			return
		}
	}
}
