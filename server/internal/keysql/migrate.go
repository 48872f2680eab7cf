package keysql

import (
	"context"
	_ "embed"
	"fmt"
	"maps"
	"slices"
	"strings"
)

//go:embed schema/keys.sql
var keysSQL string

// migrateLockClass is the first key of the advisory lock Migrate holds; the
// second is a hash of the schema being migrated, so migrations of different
// schemas (one per test, say) do not wait for each other.
const migrateLockClass = 0x1de4

// schemaVersion is the format of the key table this package writes, the
// version recorded in idempotency_migrations. Replicas refuse to start on a
// table of a newer format.
const schemaVersion = 1

// columns is the key table of schemaVersion: each column and its type as
// information_schema.columns.data_type names it.
var columns = map[string]string{
	"client_id":             "text",
	"idempotency_key":       "text",
	"request_method":        "text",
	"request_path":          "text",
	"request_hash":          "bytea",
	"status":                "text",
	"operation_id":          "uuid",
	"lock_token":            "bigint",
	"release_rejected":      "boolean",
	"response_status":       "integer",
	"response_content_type": "text",
	"response_headers":      "jsonb",
	"response_body":         "bytea",
	"created_at":            "timestamp with time zone",
	"locked_at":             "timestamp with time zone",
	"lease_us":              "bigint",
	"retention_us":          "bigint",
	"expires_at":            "timestamp with time zone",
}

// Conn runs statements on a store's driver, pgx or database/sql: those of
// Migrate in one transaction, those of CreateOpenKeysIndex outside a
// transaction, each on any session (its lock is a LockTx's), and
// OpenIndex.Need's catalog query anywhere.
type Conn interface {
	// Exec runs sql; without args it may hold several statements.
	Exec(ctx context.Context, sql string, args ...any) error
	// QueryRow runs sql with args and scans its one row into dest, which
	// are *int, *bool and *string.
	QueryRow(ctx context.Context, sql string, args []any, dest ...any) error
}

// Migrate creates the key table, or brings it up to the version that
// this package's statements write, in the first schema of the
// search_path, in the transaction of tx: the sequence
// idempotency_lock_tokens, the table idempotency_keys with its primary
// key and idempotency_keys_expires_idx, and the table
// idempotency_migrations, where it records the version. The open keys'
// index is CreateOpenKeysIndex's, on request; Migrate neither creates nor
// drops it. It holds a transaction-level advisory lock, so that concurrent calls apply
// what is missing once, and a second call on a table it made changes
// nothing. A table named idempotency_keys that it did not create is an
// error naming what differs. pgstore's and sqlstore's Migrate both run
// it: one table, whichever store serves it.
func Migrate(ctx context.Context, tx Conn) error {
	if err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1, hashtext(coalesce(current_schema(), '')))`, migrateLockClass); err != nil {
		return err
	}
	if err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS idempotency_migrations (
			version    integer     PRIMARY KEY,
			applied_at timestamptz NOT NULL DEFAULT now()
		)`); err != nil {
		return err
	}
	var applied int
	if err := tx.QueryRow(ctx, `SELECT coalesce(max(version), 0) FROM idempotency_migrations`, nil, &applied); err != nil {
		return err
	}
	switch {
	case applied > schemaVersion:
		return fmt.Errorf("the key table is at version %d, newer than this package's %d: upgrade the binary", applied, schemaVersion)
	case applied < schemaVersion:
		if err := createTable(ctx, tx); err != nil {
			return err
		}
		if err := tx.Exec(ctx, `INSERT INTO idempotency_migrations (version) VALUES ($1)`, schemaVersion); err != nil {
			return err
		}
	}
	return nil
}

// createTable creates the key table of schemaVersion, or adopts one of this
// version's shape; anything else in the way is an error.
func createTable(ctx context.Context, tx Conn) error {
	// The catalog first: information_schema.columns, which tableColumns
	// reads, takes a hundred milliseconds and more on a database of many
	// schemas, and a new schema has no table to compare.
	var exists bool
	if err := tx.QueryRow(ctx, `SELECT to_regclass(quote_ident(current_schema()) || '.idempotency_keys') IS NOT NULL`, nil, &exists); err != nil {
		return err
	}
	var found map[string]string
	var err error
	if exists {
		if found, err = tableColumns(ctx, tx); err != nil {
			return err
		}
	}
	switch {
	case len(found) == 0:
		if err := tx.Exec(ctx, keysSQL); err != nil {
			return fmt.Errorf("creating the key table: %w", err)
		}
	default:
		diff := shapeDiff(found)
		if diff == "" {
			diff, err = primaryKeyDiff(ctx, tx)
			if err != nil {
				return err
			}
		}
		if diff != "" {
			return fmt.Errorf("a table idempotency_keys that this package did not create is in the way (%s): rename it, or migrate into another schema", diff)
		}
		// The shape of this version, without its record (a restored
		// dump, say): adopted, with its sequence and index.
		if err := tx.Exec(ctx, adoptSQL); err != nil {
			return fmt.Errorf("adopting the key table: %w", err)
		}
	}
	return nil
}

// tableColumns returns the columns of idempotency_keys in the current
// schema and their types; none when there is no such table.
func tableColumns(ctx context.Context, tx Conn) (map[string]string, error) {
	// One row, a line per column (name, tab, type), read alike by every
	// driver.
	var list string
	err := tx.QueryRow(ctx, `
		SELECT coalesce(string_agg(column_name::text || chr(9) || data_type::text, chr(10)), '')
		FROM information_schema.columns
		WHERE table_schema = current_schema() AND table_name = 'idempotency_keys'`, nil, &list)
	found := make(map[string]string)
	for line := range strings.Lines(list) {
		name, typ, _ := strings.Cut(strings.TrimSuffix(line, "\n"), "\t")
		found[name] = typ
	}
	return found, err
}

// adoptSQL creates what a key table of this version's columns may lack
// when it is adopted without its migration record.
const adoptSQL = `
CREATE SEQUENCE IF NOT EXISTS idempotency_lock_tokens AS bigint;
CREATE INDEX IF NOT EXISTS idempotency_keys_expires_idx ON idempotency_keys (expires_at) WHERE expires_at IS NOT NULL`

// primaryKeyDiff says what is wrong with the primary key of the
// idempotency_keys table of the current schema, or returns "" when it is
// (client_id, idempotency_key), which every claim's ON CONFLICT needs.
func primaryKeyDiff(ctx context.Context, tx Conn) (string, error) {
	var list string
	err := tx.QueryRow(ctx, `
		SELECT coalesce(string_agg(a.attname::text, chr(10) ORDER BY k.n), '')
		FROM pg_constraint c
		CROSS JOIN LATERAL unnest(c.conkey) WITH ORDINALITY AS k(attnum, n)
		JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.attnum
		WHERE c.conrelid = to_regclass(quote_ident(current_schema()) || '.idempotency_keys') AND c.contype = 'p'`, nil, &list)
	var cols []string
	if list != "" {
		cols = strings.Split(list, "\n")
	}
	switch {
	case err != nil:
		return "", err
	case len(cols) == 0:
		return "no primary key", nil
	case !slices.Equal(cols, []string{"client_id", "idempotency_key"}):
		return fmt.Sprintf("primary key (%s), not (client_id, idempotency_key)", strings.Join(cols, ", ")), nil
	}
	return "", nil
}

// shapeDiff describes how found differs from this version's columns, or
// returns "" when it does not.
func shapeDiff(found map[string]string) string {
	var missing, other, extra []string
	for _, c := range slices.Sorted(maps.Keys(columns)) {
		switch typ, ok := found[c]; {
		case !ok:
			missing = append(missing, c)
		case typ != columns[c]:
			other = append(other, fmt.Sprintf("%s is %s, not %s", c, typ, columns[c]))
		}
	}
	for _, c := range slices.Sorted(maps.Keys(found)) {
		if _, ok := columns[c]; !ok {
			extra = append(extra, c)
		}
	}
	var parts []string
	if len(missing) > 0 {
		parts = append(parts, "missing columns: "+strings.Join(missing, ", "))
	}
	if len(other) > 0 {
		parts = append(parts, strings.Join(other, "; "))
	}
	if len(extra) > 0 {
		parts = append(parts, "unknown columns: "+strings.Join(extra, ", "))
	}
	return strings.Join(parts, "; ")
}
