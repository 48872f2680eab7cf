package keysql

// ElapseSQL moves every time stamped on the keys $1 microseconds back, as
// if that long had passed for them: when each operation began, its last
// lock or finish, and its expiry. Tests age keys with it (it is the
// storetest.Backend.Elapse of both stores) rather than sleep past leases
// and retentions; a test that ages some keys only appends a WHERE clause.
const ElapseSQL = `UPDATE idempotency_keys SET
	created_at = created_at - $1::bigint * interval '1 microsecond',
	locked_at = locked_at - $1::bigint * interval '1 microsecond',
	expires_at = expires_at - $1::bigint * interval '1 microsecond'`
