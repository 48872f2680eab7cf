package server

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"path"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/server/pgstore"
)

// schemaFiles holds the migrations, one file per version, named
// NNN_description.sql and applied in version order.
//
//go:embed schema/*.sql
var schemaFiles embed.FS

// migrateLockClass is the first key of the advisory lock Migrate holds; the
// second is a hash of the schema being migrated, so migrations of different
// schemas (one per test, say) do not wait for each other.
const migrateLockClass = 0x1de3 // pgstore.Migrate uses another

// Migrate brings the database of pool up to what the reference server
// needs, in the first schema of the connection's search_path: the key table
// ([pgstore.Migrate]), then the server's own tables, payments and charges,
// from the schema embedded in the binary, then the open keys' index
// ([pgstore.CreateOpenKeysIndex]), always: the server runs the sweeper, the
// operators' lists and the key gauges of /metrics, which need it, so its
// key completions are never HOT updates. The server's tables are migrated
// in one transaction under a transaction-level advisory lock, each version
// recorded in the idem_server_migrations table; the index is built
// concurrently, outside it, and only when it is missing or invalid. So
// Migrate is safe to call at every start, twice, and from many processes at
// once: one applies what is missing, the others wait for it and find
// nothing to do.
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	if err := pgstore.Migrate(ctx, pool); err != nil {
		return err
	}
	if err := migrateServer(ctx, pool); err != nil {
		return err
	}
	return pgstore.CreateOpenKeysIndex(ctx, pool)
}

// migrateServer applies the server's own migrations.
func migrateServer(ctx context.Context, pool *pgxpool.Pool) error {
	migrations, err := loadMigrations()
	if err != nil {
		return err
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1, hashtext(coalesce(current_schema(), '')))`, migrateLockClass); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS idem_server_migrations (
			version    integer     PRIMARY KEY,
			name       text        NOT NULL,
			applied_at timestamptz NOT NULL DEFAULT now()
		)`); err != nil {
			return err
		}
		rows, _ := tx.Query(ctx, `SELECT version FROM idem_server_migrations`)
		applied, err := pgx.CollectRows(rows, pgx.RowTo[int])
		if err != nil {
			return err
		}
		for _, m := range migrations {
			if slices.Contains(applied, m.version) {
				continue
			}
			if _, err := tx.Exec(ctx, m.sql); err != nil {
				return fmt.Errorf("%s: %w", m.name, err)
			}
			if _, err := tx.Exec(ctx, `INSERT INTO idem_server_migrations (version, name) VALUES ($1, $2)`, m.version, m.name); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("server: migrate: %w", err)
	}
	return nil
}

// migration is one embedded schema file.
type migration struct {
	version int
	name    string
	sql     string
}

// loadMigrations reads the embedded files in version order.
func loadMigrations() ([]migration, error) {
	entries, err := fs.ReadDir(schemaFiles, "schema")
	if err != nil {
		return nil, fmt.Errorf("server: migrate: %w", err)
	}
	var out []migration
	for _, e := range entries {
		num, _, ok := strings.Cut(e.Name(), "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil || v <= 0 {
			return nil, fmt.Errorf("server: migrate: schema file %s is not named NNN_description.sql", e.Name())
		}
		sql, err := schemaFiles.ReadFile(path.Join("schema", e.Name()))
		if err != nil {
			return nil, fmt.Errorf("server: migrate: %w", err)
		}
		out = append(out, migration{version: v, name: e.Name(), sql: string(sql)})
	}
	slices.SortFunc(out, func(a, b migration) int { return a.version - b.version })
	for i := 1; i < len(out); i++ {
		if out[i].version == out[i-1].version {
			return nil, fmt.Errorf("server: migrate: %s and %s have the same version", out[i-1].name, out[i].name)
		}
	}
	return out, nil
}
