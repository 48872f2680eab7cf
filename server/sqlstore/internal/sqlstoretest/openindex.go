package sqlstoretest

import (
	"context"
	"database/sql"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/sqlstore"
)

// openIndexOID returns the OID of idempotency_keys_open_idx in db's
// schema if it is valid, 0 if it is missing, -1 if it is invalid.
func openIndexOID(t *testing.T, db *sql.DB) int64 {
	t.Helper()
	var oid int64
	err := db.QueryRowContext(context.Background(), `
		SELECT CASE WHEN i.indexrelid IS NULL THEN 0 WHEN i.indisvalid THEN i.indexrelid::bigint ELSE -1 END
		FROM (SELECT to_regclass('idempotency_keys_open_idx') AS oid) r
		LEFT JOIN pg_index i ON i.indexrelid = r.oid`).Scan(&oid)
	if err != nil {
		t.Fatal(err)
	}
	return oid
}

// testOpenIndexOptIn: on a table from plain Migrate, the sweeper and the
// inspector's lists and stats fail with ErrNoOpenKeysIndex, naming
// sqlstore.CreateOpenKeysIndex, and lookups work; after
// CreateOpenKeysIndex, the same store sweeps the released key, and a
// second call and Migrate keep the index.
func testOpenIndexOptIn(t *testing.T, driver string) {
	ctx := context.Background()
	db := Open(t, driver)
	s := sqlstore.New(db)
	if oid := openIndexOID(t, db); oid != 0 {
		t.Fatalf("Migrate made the open keys' index (%d), want none", oid)
	}
	res, err := s.Claim(ctx, idempotency.ClaimRequest{ClientID: "cli_a", Key: "key-1", Method: "POST", Path: "/v1/orders",
		Fingerprint: []byte("a"), LockTimeout: time.Minute, Retention: time.Hour})
	if err != nil || res.Outcome != idempotency.Claimed {
		t.Fatalf("Claim = %v, %v; want claimed", res.Outcome, err)
	}
	if err := s.Release(ctx, res.Claim, idempotency.ReleaseFailed); err != nil {
		t.Fatal(err)
	}
	if k, err := s.Lookup(ctx, "cli_a", "key-1", false); err != nil || k.Status != idempotency.StatusReleased {
		t.Errorf("Lookup without the index = %+v, %v; want the released key", k, err)
	}
	sweeper := &idempotency.Sweeper{Store: s, Grace: time.Nanosecond, Logger: slog.New(slog.DiscardHandler),
		Settle: func(context.Context, idempotency.KeyInfo) (idempotency.Settlement, error) {
			return idempotency.Settlement{Release: true}, nil
		}}
	admin := &idempotency.Admin{Store: s}
	_, sweepErr := sweeper.Sweep(ctx)
	_, listErr := admin.List(ctx, idempotency.ListFilter{Status: idempotency.StatusReleased})
	_, statsErr := admin.Stats(ctx)
	for name, err := range map[string]error{"Sweep": sweepErr, "List": listErr, "Stats": statsErr} {
		if !errors.Is(err, sqlstore.ErrNoOpenKeysIndex) || !strings.Contains(err.Error(), "sqlstore.CreateOpenKeysIndex") {
			t.Errorf("%s without the index: %v; want ErrNoOpenKeysIndex, naming sqlstore.CreateOpenKeysIndex", name, err)
		}
	}

	if err := sqlstore.CreateOpenKeysIndex(ctx, db); err != nil {
		t.Fatalf("CreateOpenKeysIndex: %v", err)
	}
	oid := openIndexOID(t, db)
	if got, err := sweeper.Sweep(ctx); err != nil || got.Released != 1 {
		t.Errorf("Sweep after CreateOpenKeysIndex = %+v, %v; want the released key released", got, err)
	}
	if _, err := admin.Stats(ctx); err != nil {
		t.Errorf("Stats after CreateOpenKeysIndex: %v", err)
	}
	if err := sqlstore.CreateOpenKeysIndex(ctx, db); err != nil {
		t.Fatal(err)
	}
	if err := sqlstore.Migrate(ctx, db); err != nil {
		t.Fatal(err)
	}
	if again := openIndexOID(t, db); oid <= 0 || again != oid {
		t.Errorf("index %d after CreateOpenKeysIndex, %d after a second call and Migrate; want one valid index kept", oid, again)
	}
}

// testOpenIndexInvalid: an invalid open keys' index (as an interrupted
// concurrent build leaves it) is refused by the store, saying so, and
// CreateOpenKeysIndex drops it and builds it again.
func testOpenIndexInvalid(t *testing.T, driver string) {
	ctx := context.Background()
	db := Open(t, driver)
	if err := sqlstore.CreateOpenKeysIndex(ctx, db); err != nil {
		t.Fatal(err)
	}
	was := openIndexOID(t, db)
	if _, err := db.ExecContext(ctx, `UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'idempotency_keys_open_idx'::regclass`); err != nil {
		t.Fatal(err)
	}
	s := sqlstore.New(db)
	if _, err := s.Abandoned(ctx, time.Nanosecond, 10); !errors.Is(err, sqlstore.ErrNoOpenKeysIndex) || !strings.Contains(err.Error(), "invalid") {
		t.Errorf("Abandoned on an invalid index: %v; want ErrNoOpenKeysIndex saying it is invalid", err)
	}
	if err := sqlstore.CreateOpenKeysIndex(ctx, db); err != nil {
		t.Fatalf("CreateOpenKeysIndex over the invalid index: %v", err)
	}
	if now := openIndexOID(t, db); now <= 0 || now == was {
		t.Errorf("index %d after CreateOpenKeysIndex over the invalid %d; want a valid one built again", now, was)
	}
	if _, err := s.Abandoned(ctx, time.Nanosecond, 10); err != nil {
		t.Errorf("Abandoned after the rebuild: %v", err)
	}
}

// testOpenIndexOneConn: the build holds its lock in a transaction on a
// connection other than the one it builds on, which a db limited to one
// connection does not have: CreateOpenKeysIndex says so, rather than
// wait for it forever.
func testOpenIndexOneConn(t *testing.T, driver string) {
	db := Open(t, driver)
	db.SetMaxOpenConns(1)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := sqlstore.CreateOpenKeysIndex(ctx, db)
	if err == nil || !strings.Contains(err.Error(), "SetMaxOpenConns(1)") {
		t.Errorf("CreateOpenKeysIndex on a db of one connection: %v; want an error naming SetMaxOpenConns(1)", err)
	}
}
