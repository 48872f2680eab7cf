package idem

import (
	"sync"
	"time"
)

// DefaultFirstSentMemory is how long a [Transport] remembers the
// first-sent time of a key it sent, unless [Transport.FirstSentMemory]
// says otherwise: 24 hours, as long as Stripe keeps its keys.
const DefaultFirstSentMemory = 24 * time.Hour

// MaxRememberedKeys is the most keys whose first-sent time a [Transport]
// remembers at once (see [Transport.FirstSentMemory]): 16384, a few MiB at
// most. The keys remembered longest are forgotten first.
const MaxRememberedKeys = 1 << 14

// sentMemory remembers, in memory, the first-sent time of each key a
// Transport sent, so that a key sent again without a pinned first-sent
// time (WithKey alone) carries the time it was first sent with, not the
// time of its new call: a server that let the key go then refuses it
// rather than running the operation again. It holds at most
// MaxRememberedKeys keys, and forgets a key once its first-sent time is
// older than the horizon, on the next key it learns: no goroutine runs for
// it. Safe for concurrent use.
type sentMemory struct {
	mu    sync.Mutex
	times map[string]time.Time
	order []sentEntry // the keys in the order they were learnt, from head
	head  int
}

type sentEntry struct {
	key string
	at  time.Time
}

// firstSent returns the first-sent time remembered for key, or, if there
// is none, remembers at for it and returns at. A key is remembered within
// horizon; one whose first-sent time is older is forgotten as new keys
// come.
func (m *sentMemory) firstSent(key string, at time.Time, horizon time.Duration) time.Time {
	m.mu.Lock()
	defer m.mu.Unlock()
	if first, ok := m.times[key]; ok {
		return first
	}
	m.forget(time.Now().Add(-horizon))
	if m.times == nil {
		m.times = make(map[string]time.Time)
	}
	m.times[key] = at
	m.order = append(m.order, sentEntry{key, at})
	return at
}

// forget drops the keys first sent before oldest, and the keys learnt
// first while there are more than MaxRememberedKeys-1 (room for one
// more), as far as the order of learning finds them.
func (m *sentMemory) forget(oldest time.Time) {
	for m.head < len(m.order) {
		e := m.order[m.head]
		if len(m.times) < MaxRememberedKeys && !e.at.Before(oldest) {
			break
		}
		delete(m.times, e.key)
		m.order[m.head] = sentEntry{}
		m.head++
	}
	if m.head > 0 && m.head >= len(m.order)/2 {
		n := copy(m.order, m.order[m.head:])
		clear(m.order[n:])
		m.order, m.head = m.order[:n], 0
	}
}

// firstSentMemory returns how long the Transport remembers first-sent
// times, 0 for not at all.
func (t *Transport) firstSentMemory() time.Duration {
	switch {
	case t.FirstSentMemory < 0:
		return 0
	case t.FirstSentMemory == 0:
		return DefaultFirstSentMemory
	}
	return t.FirstSentMemory
}

// recallFirstSent gives an operation whose key was pinned (WithKey, a key
// header or body field of the caller's), without a pinned first-sent
// time, the first-sent time the Transport sent its key with before, if it
// did; else the operation's own is remembered for the key. A key made for
// the operation is new: remembered only if the operation fails (see
// rememberNewKey), when the caller may send it again.
func (op *operation) recallFirstSent() {
	if !op.newKey && op.sentHeader != "" && op.key != "" { // inlined for a new key
		op.recall()
	}
}

func (op *operation) recall() {
	horizon := op.t.firstSentMemory()
	if horizon == 0 {
		return
	}
	at := op.t.sent.firstSent(op.memoryKey(), op.sentAt, horizon)
	if _, pinnedTime := FirstSentFromContext(op.ctx); !pinnedTime && !at.Equal(op.sentAt) {
		op.sentAt = at
		op.sentValue = op.t.firstSentValue(at, nil)
	}
}

// rememberNewKey remembers the first-sent time of an operation whose key
// was made for it, when it did not end in a 2xx: its caller may send the
// key again, read from the error or the attempt's request.
func (op *operation) rememberNewKey(failed bool) {
	if failed && op.newKey && op.sentHeader != "" && op.attempts > 0 { // inlined
		op.remember()
	}
}

func (op *operation) remember() {
	if horizon := op.t.firstSentMemory(); horizon > 0 {
		op.t.sent.firstSent(op.memoryKey(), op.sentAt, horizon)
	}
}

// memoryKey is the key under which the operation's first-sent time is
// remembered: its key on its host, as servers scope keys by API (the same
// order id may key a payment at two providers).
func (op *operation) memoryKey() string {
	host := ""
	if op.req.URL != nil {
		host = op.req.URL.Host
	}
	return host + " " + op.key
}
