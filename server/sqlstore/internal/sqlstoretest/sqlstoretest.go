// Package sqlstoretest holds the tests of sqlstore that run once per
// database/sql driver: server/sqlstore runs them on pgx's stdlib, and the
// module in internal/pqtest on lib/pq, so that the root module needs no
// lib/pq. Each test opens its own pool on a schema of its own.
package sqlstoretest

import (
	"context"
	"database/sql"
	"errors"
	"net/url"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/internal/keysql"
	"github.com/idemkit/idem/server/sqlstore"
	"github.com/idemkit/idem/server/storetest"
)

// Run runs every test on driver ("pgx" or "postgres"), which the caller
// has registered.
func Run(t *testing.T, driver string) {
	for _, tt := range []struct {
		name string
		run  func(t *testing.T, driver string)
	}{
		{"Conformance", testConformance},
		{"ConformanceSerializable", testSerializable},
		{"SerializableRenewalKeepsCompletion", testSerializableRenewal},
		{"Sealed", func(t *testing.T, driver string) { storetest.ExerciseSealed(t, backend(driver)) }},
		{"Inspector", func(t *testing.T, driver string) { storetest.ExerciseInspector(t, indexedBackend(driver)) }},
		{"Sweeper", func(t *testing.T, driver string) { storetest.ExerciseSweeper(t, indexedBackend(driver)) }},
		{"OpenKeysIndexOptIn", testOpenIndexOptIn},
		{"OpenKeysIndexInvalid", testOpenIndexInvalid},
		{"OpenKeysIndexOneConnection", testOpenIndexOneConn},
		{"HandlerRowsFollowOutcome", testHandlerRows},
		{"OneKeyConcurrentlyOneRow", testConcurrentKey},
		{"ResponseByteForByte", testResponseFidelity},
		{"CancelMidStatement", testCancelMidStatement},
		{"ConnectionLostUnderClaim", testConnLost},
		{"SideBySideWithPgstore", testSideBySide},
		{"PoolAsSmallAsRequests", testPoolAsSmallAsRequests},
		{"SmallPoolAnswersEveryRequest", testSmallPoolAnswersEveryRequest},
		{"SmallPoolStopsGracefully", testSmallPoolStopsGracefully},
		{"ClaimOfRowNoStoreWrites", testCorruptRows},
		{"ClaimOnReadOnlyDatabase", testReadOnly},
		{"HandlerEndsTransaction", testHandlerEndsTransaction},
		{"DuplicateWhileHandlerEndedTransaction", testDuplicateWhileHandlerEnded},
		{"RolledBackDoesNotWaitOnDuplicate", testRolledBackDoesNotWaitOnDuplicate},
		{"PreparedTransactionFailsClosed", testPreparedTransaction},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			tt.run(t, driver)
		})
	}
}

// writesSQL creates the business table of the tests: one row per write,
// named; a second write of a name is a unique violation.
const writesSQL = `CREATE TABLE writes (name text PRIMARY KEY)`

// Open returns a pool of driver on a fresh schema, dropped when the test
// ends, holding the key table and the writes table.
func Open(t testing.TB, driver string) *sql.DB {
	t.Helper()
	db, _ := OpenURL(t, driver)
	return db
}

// OpenURL is Open, and returns the connection string of the pool too.
func OpenURL(t testing.TB, driver string) (*sql.DB, string) {
	t.Helper()
	return openURL(t, driver, "")
}

// openURL is OpenURL with more connection parameters (key=value&...).
func openURL(t testing.TB, driver, params string) (*sql.DB, string) {
	t.Helper()
	url := pgtest.SchemaURL(t)
	if params != "" {
		url += "&" + params
	}
	db := open(t, driver, url)
	ctx := context.Background()
	if err := sqlstore.Migrate(ctx, db); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, writesSQL); err != nil {
		t.Fatal(err)
	}
	warm(t, db, 8)
	return db, url
}

// warm opens n connections of db and keeps them idle in its pool, as
// pgstore's tests open their pool's, so that a race of claims is not a
// race of connection set-ups.
func warm(t testing.TB, db *sql.DB, n int) {
	t.Helper()
	db.SetMaxIdleConns(n)
	conns := make([]*sql.Conn, n)
	for i := range conns {
		c, err := db.Conn(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		conns[i] = c
	}
	for _, c := range conns {
		if err := c.PingContext(context.Background()); err != nil {
			t.Fatal(err)
		}
		c.Close()
	}
}

// open opens a pool of driver on url, closed when the test ends.
func open(t testing.TB, driver, url string) *sql.DB {
	t.Helper()
	db, err := sql.Open(driver, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	// Bounded, as pgstore's test pools are: the suite's races (50 claims
	// at once) run beside other packages' tests on one PostgreSQL, whose
	// max_connections is 100 here.
	db.SetMaxOpenConns(20)
	return db
}

// write inserts the row name through the request's transaction, as a
// handler behind the middleware does.
func write(ctx context.Context, name string) error {
	tx, err := sqlstore.Tx(ctx)
	if err != nil {
		return err
	}
	_, err = tx.ExecContext(ctx, `INSERT INTO writes (name) VALUES ($1)`, name)
	return err
}

// written reports whether the row name is committed.
func written(ctx context.Context, db *sql.DB, name string) (bool, error) {
	var ok bool
	err := db.QueryRowContext(ctx, `SELECT EXISTS (SELECT FROM writes WHERE name = $1)`, name).Scan(&ok)
	return ok, err
}

// testConformance runs the conformance suite of idempotency.Store, its
// subtests of claims in one transaction included.
func testConformance(t *testing.T, driver string) {
	storetest.Exercise(t, backend(driver))
}

// testSerializable runs the conformance suite on a database whose
// default_transaction_isolation is serializable, where the store's own
// statements and the handlers' transactions run under SERIALIZABLE.
func testSerializable(t *testing.T, driver string) {
	openAt(t, driver, "serializable")
	storetest.Exercise(t, backendWith(driver, isolationParam("serializable")))
}

// openAt is Open on a pool whose sessions' default_transaction_isolation
// is level ("": the server's), which it checks.
func openAt(t testing.TB, driver, level string) *sql.DB {
	t.Helper()
	db, _ := openURL(t, driver, isolationParam(level))
	var got string
	if err := db.QueryRowContext(context.Background(), `SHOW transaction_isolation`).Scan(&got); err != nil || level != "" && got != level {
		t.Fatalf("transaction_isolation %q (%v), want %q", got, err, level)
	}
	return db
}

// isolationParam is the connection parameter that sets the sessions'
// default_transaction_isolation to level; "" for "".
func isolationParam(level string) string {
	if level == "" {
		return ""
	}
	return "default_transaction_isolation=" + url.PathEscape(level)
}

// backend returns the storetest backend of a store on driver, on a fresh
// schema.
func backend(driver string) func(t *testing.T) storetest.Backend {
	return backendWith(driver, "")
}

// indexedBackend is backend on a key table with the open keys' index
// (sqlstore.CreateOpenKeysIndex), which the sweeper and the inspector
// need.
func indexedBackend(driver string) func(t *testing.T) storetest.Backend {
	return func(t *testing.T) storetest.Backend {
		db, _ := openURL(t, driver, "")
		if err := sqlstore.CreateOpenKeysIndex(context.Background(), db); err != nil {
			t.Fatal(err)
		}
		return backendOn(db)
	}
}

// backendWith is backend with more connection parameters.
func backendWith(driver, params string) func(t *testing.T) storetest.Backend {
	return func(t *testing.T) storetest.Backend {
		db, _ := openURL(t, driver, params)
		return backendOn(db)
	}
}

// backendOn returns the storetest backend of a store on db.
func backendOn(db *sql.DB) storetest.Backend {
	return storetest.Backend{
		Store: sqlstore.New(db),
		Write: write,
		Written: func(ctx context.Context, name string) (bool, error) {
			return written(ctx, db, name)
		},
		Elapse: func(ctx context.Context, d time.Duration) error {
			_, err := db.ExecContext(ctx, keysql.ElapseSQL, d.Microseconds())
			return err
		},
	}
}

// testReadOnly claims a key on a database that refuses writes
// (default_transaction_read_only, as a standby does): Claim fails with
// idempotency.ErrReadOnly, which the middleware answers with 503.
func testReadOnly(t *testing.T, driver string) {
	_, url := OpenURL(t, driver)
	s := sqlstore.New(open(t, driver, url+"&default_transaction_read_only=on"))
	_, err := s.Claim(context.Background(), idempotency.ClaimRequest{ClientID: "c", Key: "k", Method: "POST",
		Path: "/v1/orders", Fingerprint: []byte("fp")})
	if !errors.Is(err, idempotency.ErrReadOnly) {
		t.Errorf("Claim on a read-only database: %v, want ErrReadOnly", err)
	}
}

// Conformance runs the conformance suite on driver with more connection
// parameters (key=value&...): pgx's query modes, say.
func Conformance(t *testing.T, driver, params string) {
	storetest.Exercise(t, backendWith(driver, params))
}
