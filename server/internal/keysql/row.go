package keysql

import (
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/idemkit/idem/internal/keyheader"
	"github.com/idemkit/idem/server/idempotency"
)

// SQLSTATEs that the stores know.
const (
	CharacterNotInRepertoire = "22021" // invalid UTF-8 or a NUL byte in text
	AdminShutdown            = "57P01" // admin_shutdown: pg_terminate_backend, a fast shutdown
	ConnectionException      = "08"    // the class of connection exceptions
	SerializationFailure     = "40001" // serialization_failure
	DeadlockDetected         = "40P01" // deadlock_detected
	UniqueViolation          = "23505" // unique_violation
	ReadOnlySQLTransaction   = "25006" // read_only_sql_transaction: a standby, default_transaction_read_only
)

// Retryable reports whether code is the SQLSTATE of a statement that lost
// a race and did nothing: a serialization failure or a deadlock. The
// stores' own statements each run as a transaction of their own, in the
// database's default isolation level: under REPEATABLE READ or
// SERIALIZABLE, one that loses a race for a key's row to another (two
// takeovers of one stale key, say) fails with serialization_failure where
// READ COMMITTED would have it wait and read the row again, and the store
// runs it again, as PostgreSQL advises.
func Retryable(code string) bool {
	return code == SerializationFailure || code == DeadlockDetected
}

// ConnEnded reports whether code is the SQLSTATE of a connection that
// PostgreSQL ended under a statement: admin_shutdown, or a connection
// exception.
func ConnEnded(code string) bool {
	return code == AdminShutdown || len(code) == 5 && code[:2] == ConnectionException
}

// MaxRaces bounds how often one call re-runs a statement that lost a race
// (see ClaimSQL); each re-run means another caller made progress.
const MaxRaces = 10

// ClaimArgs returns the parameters of ClaimSQL and its kin for req ($1 to
// $10); ClaimInsertSQL takes ClaimInsertArgs.
func ClaimArgs(req idempotency.ClaimRequest) []any {
	var earliest *time.Time // NULL: no such rule
	if !req.FirstSent.EarliestBegin.IsZero() {
		earliest = &req.FirstSent.EarliestBegin
	}
	return []any{req.ClientID, req.Key, req.Method, req.Path, req.Fingerprint,
		Micros(req.LockTimeout), Micros(req.Retention), req.OperationID(), req.FirstSent.Stale, earliest}
}

// ClaimInsertArgs returns the parameters of ClaimInsertSQL for req, with
// the operation ID opID (req.OperationID()) and token (NewToken).
func ClaimInsertArgs(req idempotency.ClaimRequest, opID string, token int64) []any {
	return []any{req.ClientID, req.Key, req.Method, req.Path, req.Fingerprint,
		Micros(req.LockTimeout), Micros(req.Retention), opID, token}
}

// NewToken returns the fencing token of a new key's claim
// (ClaimInsertSQL, ClaimTxSQL): a random positive 63-bit number. Tokens
// are only compared for equality, with the one stored with the key, and
// two claims of one key share one with a chance of 2^-63; a token drawn
// by the store needs no sequence, and no statement of PostgreSQL's, and
// is no more likely to come again when a key's row is lost with a
// failover (a sequence on a promoted standby can hand out values again).
// ClaimSQL (which renews a key's row, or inserts it after a lost race)
// and an operator's statements take theirs from the sequence
// idempotency_lock_tokens.
func NewToken() int64 {
	return rand.Int64N(math.MaxInt64) + 1
}

// Resent reports whether req is a retry, by its first-sent time: a second
// or more before now (the time is sent to the second). A retry's key has a
// row more often than not (a replay, a duplicate), and a store reads it
// with the claim (ClaimPeekSQL); a first attempt's has none. A client
// clock that runs late or early only moves the cost of a read.
func Resent(req idempotency.ClaimRequest, now time.Time) bool {
	return !req.FirstSent.Sent.IsZero() && now.Sub(req.FirstSent.Sent) >= time.Second
}

// Micros returns d in microseconds for a lease or retention column: 0
// (never) for zero or less, at least 1 otherwise.
func Micros(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return max(d.Microseconds(), 1)
}

// CheckText refuses, before it reaches PostgreSQL, text that a text
// column would refuse (SQLSTATE 22021), so the stores answer as the memory
// store.
func CheckText(fields ...string) error {
	for _, f := range fields {
		if !idempotency.ValidText(f) {
			return fmt.Errorf("%w: %q", idempotency.ErrInvalidText, f)
		}
	}
	return nil
}

// CheckClaim refuses, before it reaches PostgreSQL, a claim whose text a
// text column would refuse or whose key is not 1 to 255 bytes, so the
// stores answer as the memory store (the key table has no CHECK
// constraints: see schema/keys.sql).
func CheckClaim(req idempotency.ClaimRequest) error {
	if err := CheckText(req.ClientID, req.Key, req.Method, req.Path); err != nil {
		return err
	}
	if len(req.Key) < 1 || len(req.Key) > keyheader.MaxLen {
		return fmt.Errorf("%w: %d bytes", idempotency.ErrInvalidKey, len(req.Key))
	}
	return nil
}

// Fenced is the answer of a statement that updates a key under its
// claim's token (a renewal, a release, a completion): err if it failed,
// else [idempotency.ErrFenced] unless it updated the key (done).
func Fenced(done bool, err error) error {
	if err == nil && !done {
		return idempotency.ErrFenced
	}
	return err
}

// ClaimRow is one row of ClaimSQL or ClaimReadSQL, or the key's row of
// ClaimPeekSQL (PeekRow).
type ClaimRow struct {
	Code            int32 // the outcome: an idempotency.Outcome
	Token           *int64
	OperationID     *string
	Method, Path    *string
	Fingerprint     []byte
	Status          *string
	RespStatus      *int32
	RespContentType *string
	RespHeader      map[string]string
	RespBody        []byte
	CreatedAt       *time.Time
	LockedAt        *time.Time
	RetentionUS     *int64 // of a row found: the retention stored with it
	Lost            bool   // outcome 3 of a row that ClaimSQL may renew: run ClaimSQL (again)
	Resumed         bool   // outcome 1 or 2: see idempotency.Claim.Resumed
}

// Dests returns the scan destinations of a claim row's columns, in order;
// header is the one of the response headers (jsonb): &r.RespHeader for a
// driver that decodes JSON into a map, as pgx does, or a scanner that
// fills r.RespHeader.
func (r *ClaimRow) Dests(header any) []any {
	return []any{&r.Code, &r.Token, &r.OperationID,
		&r.Method, &r.Path, &r.Fingerprint, &r.Status,
		&r.RespStatus, &r.RespContentType, header, &r.RespBody, &r.CreatedAt, &r.LockedAt,
		&r.RetentionUS, &r.Lost, &r.Resumed}
}

// Outcome is the row's outcome.
func (r *ClaimRow) Outcome() idempotency.Outcome { return idempotency.Outcome(r.Code) }

// Result is the outcome of a claim of req that returned r, which is not
// lost. A row that no store writes (an unknown status, a completed key
// without a response status or with one outside 100 to 599: the key table
// has no CHECK constraints to refuse them, see schema/keys.sql) is
// an error, never a replay or a 409.
func (r *ClaimRow) Result(req idempotency.ClaimRequest) (idempotency.ClaimResult, error) {
	switch r.Outcome() {
	case idempotency.Refused, idempotency.Busy:
		return idempotency.ClaimResult{Outcome: r.Outcome()}, nil
	case idempotency.Claimed, idempotency.TookOver:
		return idempotency.ClaimResult{Outcome: r.Outcome(), Claim: idempotency.Claim{
			ClientID:    req.ClientID,
			Key:         req.Key,
			Token:       *r.Token,
			OperationID: *r.OperationID,
			Resumed:     r.Resumed,
		}}, nil
	}
	switch st := idempotency.Status(*r.Status); {
	case st != idempotency.StatusStarted && st != idempotency.StatusCompleted && st != idempotency.StatusReleased:
		return idempotency.ClaimResult{}, fmt.Errorf("the key table's row of key %q has status %q, which no store writes", req.Key, st)
	case st == idempotency.StatusCompleted && r.RespStatus == nil:
		return idempotency.ClaimResult{}, fmt.Errorf("the key table's row of key %q is completed without a response status, which no store writes", req.Key)
	case st != idempotency.StatusCompleted && r.RespStatus != nil:
		return idempotency.ClaimResult{}, fmt.Errorf("the key table's row of key %q has status %q and a response status, which no store writes", req.Key, st)
	case r.RespStatus != nil && !idempotency.ValidStatus(int(*r.RespStatus)):
		return idempotency.ClaimResult{}, fmt.Errorf("the key table's row of key %q has response status %d, which no store writes", req.Key, *r.RespStatus)
	}
	rec := &idempotency.Record{
		ClientID:    req.ClientID,
		Key:         req.Key,
		Method:      *r.Method,
		Path:        *r.Path,
		Fingerprint: r.Fingerprint,
		Status:      idempotency.Status(*r.Status),
		CreatedAt:   *r.CreatedAt,
	}
	if r.LockedAt != nil {
		rec.LockedAt = *r.LockedAt
	}
	if r.OperationID != nil {
		rec.OperationID = *r.OperationID
	}
	if r.RetentionUS != nil {
		rec.Retention = time.Duration(*r.RetentionUS) * time.Microsecond
	}
	if rec.Status == idempotency.StatusCompleted {
		rec.Response = &idempotency.StoredResponse{
			Status: int(*r.RespStatus),
			Header: r.RespHeader,
			Body:   r.RespBody,
		}
		if r.RespContentType != nil {
			rec.Response.ContentType = *r.RespContentType
		}
	}
	return idempotency.ClaimResult{Outcome: idempotency.Exists, Record: rec}, nil
}

// PeekRow is the row of ClaimPeekSQL: a key's row, with the database's
// time. Its columns that are never NULL scan into values, not pointers,
// which a driver scans with less work (pgx scans into a pointer to a
// pointer by reflection, and allocates what it points to, every row).
type PeekRow struct {
	OperationID, Method, Path, Status string
	Fingerprint                       []byte
	RespStatus                        *int32
	RespContentType                   *string
	RespHeader                        map[string]string
	RespBody                          []byte
	CreatedAt, LockedAt               time.Time
	RetentionUS, LeaseUS              int64
	ExpiresAt                         *time.Time
	Rejected                          bool
	Now                               time.Time
}

// PeekArgs returns the parameters of ClaimPeekSQL for req.
func PeekArgs(req idempotency.ClaimRequest) []any {
	return []any{req.ClientID, req.Key}
}

// Dests returns the scan destinations of the row's columns, in order;
// header as for [ClaimRow.Dests].
func (r *PeekRow) Dests(header any) []any {
	return []any{&r.OperationID, &r.Method, &r.Path, &r.Fingerprint, &r.Status,
		&r.RespStatus, &r.RespContentType, header, &r.RespBody,
		&r.CreatedAt, &r.LockedAt, &r.RetentionUS, &r.LeaseUS, &r.ExpiresAt, &r.Rejected,
		&r.Now}
}

// Decide returns the row as ClaimReadSQL returns a key's row for req:
// outcome 4 (Refused) when the key is expired and req's first-sent check
// says it may belong to the key's operation (refusedExpr), else 3
// (Exists), flagged lost when ClaimSQL would renew the row (expired,
// stale or free). Its rules are expiredExpr, staleExpr and existingCTE's
// free, at the database's time, in microseconds as PostgreSQL counts.
func (r *PeekRow) Decide(req idempotency.ClaimRequest) ClaimRow {
	status := idempotency.Status(r.Status)
	started := status == idempotency.StatusStarted
	now, locked := r.Now.UnixMicro(), r.LockedAt.UnixMicro()
	same := string(r.Fingerprint) == string(req.Fingerprint)
	expired := false
	if r.RetentionUS > 0 && (!started || r.LeaseUS > 0) {
		expiry := locked + r.RetentionUS
		if started {
			expiry += r.LeaseUS
		}
		if r.ExpiresAt != nil {
			expiry = max(expiry, r.ExpiresAt.UnixMicro())
		}
		expired = expiry < now
	}
	stale := started && r.LeaseUS > 0 && locked < now-r.LeaseUS && same
	free := status == idempotency.StatusReleased && (r.Rejected || same)
	early := req.FirstSent.EarliestBegin
	refused := expired && (req.FirstSent.Stale ||
		!early.IsZero() && !r.CreatedAt.Before(early.Truncate(time.Microsecond)))
	c := ClaimRow{
		Code:        int32(idempotency.Exists),
		OperationID: &r.OperationID, Method: &r.Method, Path: &r.Path, Fingerprint: r.Fingerprint,
		Status: &r.Status, RespStatus: r.RespStatus, RespContentType: r.RespContentType,
		RespHeader: r.RespHeader, RespBody: r.RespBody, CreatedAt: &r.CreatedAt, LockedAt: &r.LockedAt,
		RetentionUS: &r.RetentionUS,
		Lost:        (expired || stale || free) && !refused,
	}
	if refused {
		c.Code = int32(idempotency.Refused)
	}
	return c
}

// InfoRow is one row of InfoColumns and a body, as LookupSQL, ListSQL,
// ActSQL and AbandonedSQL return them.
type InfoRow struct {
	Info                  idempotency.KeyInfo
	Status                string
	Rejected              bool
	Finished, Expires     *time.Time
	Lease, Retention, Age int64
	RespStatus            *int32
	RespContentType       *string
	RespHeader            map[string]string
	RespBody              []byte
}

// Dests returns the scan destinations of the row's columns, in order;
// header as for [ClaimRow.Dests].
func (r *InfoRow) Dests(header any) []any {
	k := &r.Info
	return []any{&k.ClientID, &k.Key, &k.Method, &k.Path, &r.Status, &r.Rejected,
		&k.OperationID, &k.Token, &k.CreatedAt, &k.LockedAt, &r.Finished,
		&r.Expires, &r.Lease, &r.Retention, &r.Age,
		&k.Lapsed, &k.Expired,
		&r.RespStatus, &r.RespContentType, header, &r.RespBody}
}

// KeyInfo is the key that the scanned row describes.
func (r *InfoRow) KeyInfo() idempotency.KeyInfo {
	k := r.Info
	k.Status = idempotency.Status(r.Status)
	if k.Status == idempotency.StatusReleased && r.Rejected {
		k.ReleaseKind = idempotency.ReleaseRejected
	}
	if r.Finished != nil {
		k.FinishedAt = *r.Finished
	}
	if r.Expires != nil {
		k.ExpiresAt = *r.Expires
	}
	k.Lease = time.Duration(r.Lease) * time.Microsecond
	k.Retention = time.Duration(r.Retention) * time.Microsecond
	k.LeaseAge = time.Duration(r.Age) * time.Microsecond
	if r.RespStatus != nil {
		k.Response = &idempotency.StoredResponse{Status: int(*r.RespStatus), Header: r.RespHeader, Body: r.RespBody}
		if r.RespContentType != nil {
			k.Response.ContentType = *r.RespContentType
		}
	}
	return k
}
