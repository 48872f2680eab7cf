// Package testhooks hands the tests of the packages under server the
// unexported seams of the packages they build on, so that no test seam
// becomes an exported name. Only tests call these hooks.
package testhooks

import "time"

// ElapseMemoryStore makes every time an *idempotency.MemoryStore has
// stamped on its keys d earlier, as if d had passed for them: what moving
// the rows' times in SQL is to the PostgreSQL stores. Package idempotency
// sets it.
var ElapseMemoryStore func(store any, d time.Duration)
