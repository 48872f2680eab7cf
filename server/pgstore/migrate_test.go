package pgstore_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
)

// relations lists the relations of the pool's schema (tables, sequences,
// indexes, views...), each as "name (kind)", sorted.
func relations(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	rows, _ := pool.Query(context.Background(), `
		SELECT relname || ' (' || relkind::text || ')' FROM pg_class
		WHERE relnamespace = current_schema()::regnamespace ORDER BY relname`)
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return strings.Join(names, ", ")
}

// ownRelations are the relations Migrate creates, and the only ones: not
// the open keys' index, which is CreateOpenKeysIndex's.
const ownRelations = "idempotency_keys (r), idempotency_keys_expires_idx (i), idempotency_keys_pkey (i), " +
	"idempotency_lock_tokens (S), idempotency_migrations (r), idempotency_migrations_pkey (i)"

// TestMigrateCreatesOnlyItsOwn: Migrate creates the key table, its
// sequence, its index and its migration record, nothing else; again, it
// changes nothing; run by many goroutines at once, every one succeeds and
// one version is recorded.
func TestMigrateCreatesOnlyItsOwn(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t)
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Go(func() { errs[i] = pgstore.Migrate(ctx, pool) })
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatalf("concurrent Migrate: %v", err)
		}
	}
	if got := relations(t, pool); got != ownRelations {
		t.Errorf("relations after Migrate:\n%s\nwant\n%s", got, ownRelations)
	}
	var versions int
	var applied time.Time
	if err := pool.QueryRow(ctx, `SELECT count(*), max(applied_at) FROM idempotency_migrations`).Scan(&versions, &applied); err != nil {
		t.Fatal(err)
	}
	if versions != 1 {
		t.Errorf("%d versions recorded, want 1", versions)
	}

	s := pgstore.New(pool)
	c := mustClaim(t, s, req("key-1", "a"), idempotency.Claimed).Claim
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatalf("Migrate again: %v", err)
	}
	var again time.Time
	if err := pool.QueryRow(ctx, `SELECT count(*), max(applied_at) FROM idempotency_migrations`).Scan(&versions, &again); err != nil {
		t.Fatal(err)
	}
	if versions != 1 || !again.Equal(applied) {
		t.Errorf("after Migrate again: %d versions, applied %v; want 1, %v", versions, again, applied)
	}
	if got := relations(t, pool); got != ownRelations {
		t.Errorf("relations after Migrate again:\n%s\nwant\n%s", got, ownRelations)
	}
	if err := s.Release(context.Background(), c, idempotency.ReleaseRejected); err != nil {
		t.Errorf("a key claimed before Migrate again: %v", err)
	}
}

// TestMigrateLeavesOtherTablesAlone: the service's own tables, one of them
// named payments as the reference server's was, are neither created,
// changed nor emptied.
func TestMigrateLeavesOtherTablesAlone(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t)
	if _, err := pool.Exec(ctx, `CREATE TABLE payments (id int PRIMARY KEY, note text);
		INSERT INTO payments VALUES (1, 'mine')`); err != nil {
		t.Fatal(err)
	}
	payments := snapshot(t, pool, "payments")
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	want := ownRelations + ", payments (r), payments_pkey (i)"
	if got := relations(t, pool); got != want {
		t.Errorf("relations:\n%s\nwant\n%s", got, want)
	}
	if got := snapshot(t, pool, "payments"); got != payments || got != "id integer, note text: (1,mine)" {
		t.Errorf("payments after Migrate: %s, want as before: %s", got, payments)
	}
}

// TestMigrateFingerprintVersionColumn: a key table with the
// fingerprint_version column, NOT NULL, as Migrate made it before the
// fingerprint had one canonical form, gets a default for it, so that the
// stores' claims, which no longer write it, insert keys; its keys keep
// replaying; Migrate again changes nothing.
func TestMigrateFingerprintVersionColumn(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t)
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `
		ALTER TABLE idempotency_keys ADD COLUMN fingerprint_version integer NOT NULL;
		INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path, request_hash,
			fingerprint_version, status, operation_id, lock_token, response_status, lease_us, retention_us)
		VALUES ('cli_a', 'done', 'POST', '/v1/orders', 'a', 1, 'completed', gen_random_uuid(),
			nextval('idempotency_lock_tokens'), 201, 0, 0)`); err != nil {
		t.Fatal(err)
	}
	before := relations(t, pool)
	for range 2 {
		if err := pgstore.Migrate(ctx, pool); err != nil {
			t.Fatalf("Migrate of a table with fingerprint_version: %v", err)
		}
	}
	if got := relations(t, pool); got != before {
		t.Errorf("relations after Migrate:\n%s\nwant as before:\n%s", got, before)
	}
	s := pgstore.New(pool)
	if rec := mustClaim(t, s, req("done", "a"), idempotency.Exists).Record; rec.Status != idempotency.StatusCompleted {
		t.Errorf("the key stored before: %q, want completed", rec.Status)
	}
	mustComplete(t, s, mustClaim(t, s, req("new", "a"), idempotency.Claimed).Claim)
	res, err := s.ClaimInTx(ctx, req("new-in-tx", "a"))
	if err != nil || res.Outcome != idempotency.Claimed {
		t.Fatalf("ClaimInTx = %+v, %v; want Claimed", res, err)
	}
	mustComplete(t, s, res.Claim)
	rows, _ := pool.Query(ctx, `SELECT fingerprint_version FROM idempotency_keys ORDER BY idempotency_key`)
	versions, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil || len(versions) != 3 || versions[0] != 1 || versions[1] != 1 || versions[2] != 1 {
		t.Errorf("fingerprint_version of the keys: %v, %v; want 1 for all three", versions, err)
	}
}

// snapshot returns the columns and the rows of table, as text.
func snapshot(t *testing.T, pool *pgxpool.Pool, table string) string {
	t.Helper()
	ctx := context.Background()
	rows, _ := pool.Query(ctx, `SELECT column_name || ' ' || data_type FROM information_schema.columns
		WHERE table_schema = current_schema() AND table_name = $1 ORDER BY ordinal_position`, table)
	cols, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	rows, _ = pool.Query(ctx, `SELECT t::text FROM `+pgx.Identifier{table}.Sanitize()+` t ORDER BY 1`)
	vals, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return strings.Join(cols, ", ") + ": " + strings.Join(vals, "; ")
}

// TestMigrateRefusesForeignKeyTable: an idempotency_keys table that
// pgstore did not create (a service's own, or one of another shape) is an
// error naming the differences, and Migrate changes nothing: no relation
// created, the table and its rows as they were.
func TestMigrateRefusesForeignKeyTable(t *testing.T) {
	ctx := context.Background()
	for _, tt := range []struct {
		name, create string
		wantErr      []string
	}{
		{"user table", `CREATE TABLE idempotency_keys (id int); INSERT INTO idempotency_keys VALUES (7)`,
			[]string{"idempotency_keys", "missing columns: client_id", "unknown columns: id"}},
		{"other types", `CREATE TABLE idempotency_keys (` + strings.ReplaceAll(keysColumns, "lock_token bigint", "lock_token text") + `)`,
			[]string{"lock_token is text, not bigint"}},
		// The right columns without the primary key that claims rely on
		// (ON CONFLICT (client_id, idempotency_key)), nor the sequence:
		// every claim would fail.
		{"no primary key", `CREATE TABLE idempotency_keys (` + keysColumns + `)`,
			[]string{"idempotency_keys"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			pool := pgtest.Pool(t)
			if _, err := pool.Exec(ctx, tt.create); err != nil {
				t.Fatal(err)
			}
			before := relations(t, pool)
			err := pgstore.Migrate(ctx, pool)
			if err == nil {
				t.Fatal("Migrate over a foreign idempotency_keys: nil, want an error")
			}
			for _, w := range tt.wantErr {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Migrate: %v; want it to say %q", err, w)
				}
			}
			if after := relations(t, pool); after != before {
				t.Errorf("relations after the refused Migrate:\n%s\nwant as before:\n%s", after, before)
			}
			if tt.name == "user table" {
				var id int
				if err := pool.QueryRow(ctx, `SELECT id FROM idempotency_keys`).Scan(&id); err != nil || id != 7 {
					t.Errorf("the user's row: %d, %v; want 7", id, err)
				}
			}
		})
	}
}

// keysColumns are the columns of pgstore's key table, as a CREATE TABLE
// lists them.
const keysColumns = `client_id text, idempotency_key text, request_method text, request_path text,
	request_hash bytea, status text, operation_id uuid, lock_token bigint,
	release_rejected boolean, response_status integer, response_content_type text, response_headers jsonb,
	response_body bytea, created_at timestamptz, locked_at timestamptz, lease_us bigint, retention_us bigint,
	expires_at timestamptz`

// The key table of idem-server before package pgstore, as its schema
// versions 1 to 3 made it (git show f4d7c9b:server/schema/00[123]*.sql),
// with its payments and charges tables, and its migration record.
const (
	legacy001 = `
CREATE SEQUENCE IF NOT EXISTS idempotency_lock_tokens AS bigint;

CREATE TABLE IF NOT EXISTS idempotency_keys (
    client_id             text        NOT NULL,
    idempotency_key       text        NOT NULL,
    request_method        text        NOT NULL,
    request_path          text        NOT NULL,
    request_hash          bytea       NOT NULL,
    fingerprint_version   integer     NOT NULL,
    status                text        NOT NULL,
    operation_id          uuid        NOT NULL,
    lock_token            bigint      NOT NULL,
    response_status       integer,
    response_content_type text,
    response_headers      jsonb,
    response_body         bytea,
    created_at            timestamptz NOT NULL DEFAULT now(),
    locked_at             timestamptz,
    CONSTRAINT idempotency_keys_pkey PRIMARY KEY (client_id, idempotency_key),
    CONSTRAINT idempotency_keys_key_check CHECK (octet_length(idempotency_key) BETWEEN 1 AND 255),
    CONSTRAINT idempotency_keys_status_check CHECK (status IN ('started', 'completed')),
    CONSTRAINT idempotency_keys_response_check CHECK ((status = 'completed') = (response_status IS NOT NULL)),
    CONSTRAINT idempotency_keys_response_status_check CHECK (response_status BETWEEN 100 AND 599)
);

CREATE INDEX IF NOT EXISTS idempotency_keys_created_idx ON idempotency_keys (created_at);

CREATE TABLE IF NOT EXISTS payments (
    payment_id      text        NOT NULL,
    client_id       text        NOT NULL,
    customer_id     text        NOT NULL,
    amount          bigint      NOT NULL,
    currency        text        NOT NULL,
    idempotency_key text        NOT NULL,
    operation_id    uuid        NOT NULL,
    charge_id       text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT payments_pkey PRIMARY KEY (payment_id),
    CONSTRAINT payments_client_operation_key UNIQUE (client_id, operation_id),
    CONSTRAINT payments_amount_check CHECK (amount > 0),
    CONSTRAINT payments_currency_check CHECK (currency <> '')
);

CREATE TABLE IF NOT EXISTS charges (
    charge_id       text        NOT NULL,
    idempotency_key text        NOT NULL,
    amount          bigint      NOT NULL,
    currency        text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT charges_pkey PRIMARY KEY (charge_id),
    CONSTRAINT charges_idempotency_key_key UNIQUE (idempotency_key)
);`
	legacy002 = `
ALTER TABLE idempotency_keys DROP CONSTRAINT IF EXISTS idempotency_keys_status_check;
ALTER TABLE idempotency_keys ADD CONSTRAINT idempotency_keys_status_check
    CHECK (status IN ('started', 'completed', 'released')) NOT VALID;`
	legacy003 = `
ALTER TABLE idempotency_keys ADD COLUMN IF NOT EXISTS release_rejected boolean NOT NULL DEFAULT false;`
	legacyMigrations = `
CREATE TABLE idem_schema_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);`
)

// TestMigrateUpgradesLegacyKeyTable upgrades in place the key table of an
// idem-server from before pgstore (schema version 1, and 3), with keys in
// it as such a server left them: a completed key, a started one whose
// server crashed a minute ago, a released one (version 3). The keys keep
// working: the completed one replays, the started one is taken over under
// its operation, the released one resumes for its own request only; each
// gets an expiry. The payments and charges tables of the old server, and
// its migration record, are left as they were.
func TestMigrateUpgradesLegacyKeyTable(t *testing.T) {
	ctx := context.Background()
	for _, tt := range []struct {
		name    string
		schema  string
		version string
	}{
		{"version 1", legacy001, "(1, '001_init.sql')"},
		{"version 3", legacy001 + legacy002 + legacy003, "(1, '001_init.sql'), (2, '002_released.sql'), (3, '003_release_kind.sql')"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			pool := pgtest.Pool(t)
			if _, err := pool.Exec(ctx, tt.schema+legacyMigrations+`
				INSERT INTO idem_schema_migrations (version, name) VALUES `+tt.version); err != nil {
				t.Fatal(err)
			}
			if _, err := pool.Exec(ctx, `
				INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path, request_hash,
					fingerprint_version, status, operation_id, lock_token, response_status, response_content_type,
					response_body, created_at, locked_at)
				VALUES ('cli_a', 'done', 'POST', '/v1/payments', 'done', 1, 'completed', gen_random_uuid(),
					nextval('idempotency_lock_tokens'), 201, 'application/json', '{"id":"pay_1"}', now() - interval '1 hour', now() - interval '1 hour');
				INSERT INTO payments (payment_id, client_id, customer_id, amount, currency, idempotency_key, operation_id)
				VALUES ('pay_1', 'cli_a', 'cus_1', 4200, 'usd', 'done', gen_random_uuid());
				INSERT INTO charges (charge_id, idempotency_key, amount, currency) VALUES ('ch_1', 'k', 4200, 'usd')`); err != nil {
				t.Fatal(err)
			}
			var crashed idempotency.Claim
			if err := pool.QueryRow(ctx, `
				INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path, request_hash,
					fingerprint_version, status, operation_id, lock_token, created_at, locked_at)
				VALUES ('cli_a', 'crashed', 'POST', '/v1/payments', 'crashed', 1, 'started', gen_random_uuid(),
					nextval('idempotency_lock_tokens'), now() - interval '1 minute', now() - interval '1 minute')
				RETURNING client_id, idempotency_key, lock_token, operation_id::text`).Scan(
				&crashed.ClientID, &crashed.Key, &crashed.Token, &crashed.OperationID); err != nil {
				t.Fatal(err)
			}
			var releasedOp string
			if tt.name == "version 3" {
				if err := pool.QueryRow(ctx, `
					INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path, request_hash,
						fingerprint_version, status, operation_id, lock_token, created_at, locked_at)
					VALUES ('cli_a', 'released', 'POST', '/v1/payments', 'released', 1, 'released', gen_random_uuid(),
						nextval('idempotency_lock_tokens'), now(), NULL)
					RETURNING operation_id::text`).Scan(&releasedOp); err != nil {
					t.Fatal(err)
				}
			}
			before := make(map[string]string)
			for _, table := range []string{"payments", "charges", "idem_schema_migrations"} {
				before[table] = snapshot(t, pool, table)
			}
			for range 2 { // and again: nothing to do
				if err := pgstore.Migrate(ctx, pool); err != nil {
					t.Fatalf("Migrate of the legacy key table: %v", err)
				}
			}

			var noExpiry, versions int
			if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM idempotency_keys WHERE expires_at IS NULL),
				(SELECT count(*) FROM idempotency_migrations)`).Scan(&noExpiry, &versions); err != nil {
				t.Fatal(err)
			}
			if noExpiry != 0 || versions != 1 {
				t.Errorf("after the upgrade: %d keys without an expiry, %d versions recorded; want 0 and 1", noExpiry, versions)
			}
			for table, was := range before {
				if got := snapshot(t, pool, table); got != was {
					t.Errorf("%s after the upgrade:\n%s\nwant as before:\n%s", table, got, was)
				}
			}
			if !strings.Contains(before["payments"], "pay_1") {
				t.Errorf("payments before the upgrade: %s, want pay_1 in it", before["payments"])
			}

			s := pgstore.New(pool)
			legacyReq := func(key string) idempotency.ClaimRequest {
				return idempotency.ClaimRequest{ClientID: "cli_a", Key: key, Method: "POST", Path: "/v1/payments",
					Fingerprint: []byte(key), LockTimeout: 30 * time.Second, Retention: 24 * time.Hour}
			}
			rec := mustClaim(t, s, legacyReq("done"), idempotency.Exists).Record
			if rec.Status != idempotency.StatusCompleted || rec.Response == nil || rec.Response.Status != 201 ||
				string(rec.Response.Body) != `{"id":"pay_1"}` || rec.Response.ContentType != "application/json" {
				t.Errorf("completed legacy key: %+v, want its response replayed", rec)
			}
			taker := mustClaim(t, s, legacyReq("crashed"), idempotency.TookOver).Claim
			if taker.OperationID != crashed.OperationID {
				t.Errorf("takeover of the legacy started key under operation %s, want %s", taker.OperationID, crashed.OperationID)
			}
			if err := s.Release(ctx, crashed, idempotency.ReleaseFailed); err == nil {
				t.Errorf("Release under the crashed owner's token succeeded, want ErrFenced")
			}
			mustComplete(t, s, taker)
			if tt.name == "version 3" {
				other := legacyReq("released")
				other.Fingerprint = []byte("other")
				if rec := mustClaim(t, s, other, idempotency.Exists).Record; rec.Status != idempotency.StatusReleased {
					t.Errorf("another request on the legacy released key: %q, want released (a mismatch)", rec.Status)
				}
				resumed := mustClaim(t, s, legacyReq("released"), idempotency.Claimed).Claim
				if resumed.OperationID != releasedOp {
					t.Errorf("legacy released key resumed under %s, want %s", resumed.OperationID, releasedOp)
				}
			}
			// A new key works too, and the purge walks the new index.
			mustComplete(t, s, mustClaim(t, s, legacyReq("new"), idempotency.Claimed).Claim)
			if _, err := s.Purge(ctx, 10); err != nil {
				t.Errorf("Purge after the upgrade: %v", err)
			}
			want := "charges (r), charges_idempotency_key_key (i), charges_pkey (i), idem_schema_migrations (r), " +
				"idem_schema_migrations_pkey (i), " + ownRelations +
				", payments (r), payments_client_operation_key (i), payments_pkey (i)"
			if got := relations(t, pool); got != want {
				t.Errorf("relations after the upgrade:\n%s\nwant\n%s", got, want)
			}
		})
	}
}
