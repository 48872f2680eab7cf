package main

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// withParams returns the connection string conn with the run-time
// parameters params added, in either form pgx accepts: a postgres:// URL
// (as query parameters) or keyword=value pairs. pgx sends settings it does
// not know itself, such as search_path, to the server as run-time
// parameters. The values must be plain identifiers.
func withParams(conn string, params [][2]string) string {
	if strings.HasPrefix(conn, "postgres://") || strings.HasPrefix(conn, "postgresql://") {
		if u, err := url.Parse(conn); err == nil {
			q := u.Query()
			for _, p := range params {
				q.Set(p[0], p[1])
			}
			u.RawQuery = q.Encode()
			return u.String()
		}
	}
	var b strings.Builder
	b.WriteString(strings.TrimSpace(conn))
	for _, p := range params {
		fmt.Fprintf(&b, " %s=%s", p[0], p[1])
	}
	return b.String()
}

// redactURL hides the password of a postgres:// URL for the report.
func redactURL(conn string) string {
	if u, err := url.Parse(conn); err == nil && u.User != nil {
		if _, ok := u.User.Password(); ok {
			u.User = url.UserPassword(u.User.Username(), "xxxxx")
			return u.String()
		}
		return conn
	}
	if strings.Contains(conn, "password") {
		return "(a connection string with a password)"
	}
	return conn
}

// database is the run's own schema and a small pool for the run's own
// statements: creating and dropping the schema, terminating the replicas'
// backends, and the final check.
type database struct {
	base    string // the connection string given
	schema  string
	pool    *pgxpool.Pool
	bouncer string // the connection string of the replicas' PgBouncer, if any
	mode    string // the replicas' default_query_exec_mode, if any
}

// openDatabase connects to conn and creates the schema.
func openDatabase(ctx context.Context, conn, schema, appName string) (*database, error) {
	cfg, err := pgxpool.ParseConfig(withParams(conn, [][2]string{{"application_name", appName}}))
	if err != nil {
		return nil, fmt.Errorf("database URL: %w", err)
	}
	cfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("database: %w", err)
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := pool.Exec(pctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		pool.Close()
		return nil, fmt.Errorf("database %s: creating schema %s: %w (is PostgreSQL running? set -database-url)", redactURL(conn), schema, err)
	}
	return &database{base: conn, schema: schema, pool: pool}, nil
}

// serverURL is the connection string of a replica: the run's schema as its
// search_path (where idem-server creates its tables), and an application
// name of its own, by which its backends are found to be terminated;
// through the PgBouncer, if any, which sets the search_path itself (a
// pooler in transaction mode keeps no setting a client sends) and gives
// each backend the name of the replica it serves last.
func (d *database) serverURL(appName string) string {
	params := [][2]string{{"application_name", appName}}
	if d.mode != "" {
		params = append(params, [2]string{"default_query_exec_mode", d.mode})
	}
	if d.bouncer != "" {
		return withParams(d.bouncer, params)
	}
	return withParams(d.base, append([][2]string{{"search_path", d.schema}}, params...))
}

// table returns the qualified name of a table of the run's schema.
func (d *database) table(name string) string {
	return pgx.Identifier{d.schema, name}.Sanitize()
}

// terminate terminates the backends of the current database whose
// application name is appName, and returns how many it terminated.
func (d *database) terminate(ctx context.Context, appName string) (int, error) {
	var n int
	err := d.pool.QueryRow(ctx, `
		SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
		FROM pg_stat_activity
		WHERE datname = current_database() AND application_name = $1 AND pid <> pg_backend_pid()`,
		appName).Scan(&n)
	return n, err
}

// orphanCharges counts the downstream charges that no payment refers to.
func (d *database) orphanCharges(ctx context.Context) (int, error) {
	var n int
	err := d.pool.QueryRow(ctx, `SELECT count(*) FROM `+d.table("charges")+` c
		WHERE NOT EXISTS (SELECT FROM `+d.table("payments")+` p WHERE p.charge_id = c.charge_id)`).Scan(&n)
	return n, err
}

// close drops the schema (unless keep) and closes the pool.
func (d *database) close(keep bool) error {
	defer d.pool.Close()
	if keep {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := d.pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{d.schema}.Sanitize()+" CASCADE"); err != nil {
		return fmt.Errorf("dropping schema %s: %w", d.schema, err)
	}
	return nil
}
