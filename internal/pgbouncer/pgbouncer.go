// Package pgbouncer starts a throwaway PgBouncer in front of a PostgreSQL
// server, for the tests that run idem's stores through a pooler and for
// the chaos run (examples/chaos -pgbouncer):
//
//	b, err := pgbouncer.Start(ctx, pgbouncer.Config{Server: url, PoolMode: pgbouncer.Transaction, SearchPath: schema})
//	defer b.Close()
//	pool, err := pgxpool.New(ctx, b.URL()+" default_query_exec_mode=exec")
//
// The bouncer listens on a Unix socket in a temporary directory of its
// own, on no TCP port, so that it cannot collide with anything else on the
// machine; it serves one database, named [Database], which logs in to
// the server as the server's connection string says. A shell that waits
// on a pipe from this process runs it: when [Bouncer.Close] is called, or
// when this process exits however it exits, the shell stops PgBouncer
// and deletes the directory.
//
// PgBouncer is the binary that IDEM_PGBOUNCER names, else pgbouncer on
// PATH, else /usr/sbin/pgbouncer, where Debian's package puts it ([Find]);
// PgBouncer refuses to run as root, so as root it runs as the postgres OS
// user (-u postgres).
package pgbouncer

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Pool modes, PgBouncer's pool_mode.
const (
	// Session gives each client a server connection of its own for as
	// long as it is connected.
	Session = "session"
	// Transaction gives each client a server connection for one
	// transaction, or one statement outside a transaction: consecutive
	// statements of one client may run on different sessions.
	Transaction = "transaction"
)

// Database is the name of the one database the bouncer serves.
const Database = "idem"

// Install is the command that installs PgBouncer on Debian, named in the
// error of [Find].
const Install = "apt-get update && apt-get install -y pgbouncer"

// Config is a bouncer's configuration. Server is needed; the other fields
// have defaults.
type Config struct {
	// Server is the connection string (as pgx parses it) of the
	// PostgreSQL server behind the bouncer: its host (or Unix socket
	// directory), port, database, user and password.
	Server string
	// PoolMode is PgBouncer's pool_mode, Session or Transaction. Defaults
	// to Transaction.
	PoolMode string
	// SearchPath, if not empty, is set on each of the bouncer's server
	// connections as it connects (PgBouncer's connect_query): a pooler in
	// transaction mode keeps no setting a client sends at its start, and
	// refuses search_path among them; in session mode, the reset of a
	// server connection between two clients sets it again. It must be a
	// plain identifier, or a list of them without spaces.
	SearchPath string
	// PoolSize is the most server connections the bouncer opens
	// (default_pool_size). Defaults to 10.
	PoolSize int
	// RoundRobin makes the bouncer hand out its idle server connections in
	// turn (server_round_robin) rather than the most recently used first,
	// so that consecutive statements of one client run on different
	// sessions more often than not: session state that a store left behind
	// by mistake shows sooner.
	RoundRobin bool
	// MaxPreparedStatements, if not empty, is PgBouncer's
	// max_prepared_statements (PgBouncer 1.21 and later; 1.18 refuses
	// the setting): the named prepared statements it keeps for each
	// client in transaction mode, re-preparing them on the session the
	// client gets; "0" turns that off. Empty leaves PgBouncer's default:
	// 0 in 1.21, 200 from 1.22.
	MaxPreparedStatements string
}

// Bouncer is a running PgBouncer. Close stops it.
type Bouncer struct {
	dir   string
	port  int
	user  string
	cmd   *exec.Cmd
	alive interface{ Close() error } // the supervisor's stdin
}

// port only names the socket file in the bouncer's own directory.
const port = 6432

// startTimeout bounds the wait for a new bouncer to answer.
const startTimeout = 30 * time.Second

// supervisor runs PgBouncer in the background and waits for EOF on stdin,
// then stops it (SIGTERM: at once, whatever its clients are doing) and
// deletes the directory. Its arguments are the directory, then the
// command line of PgBouncer.
const supervisor = `dir=$1
shift
"$@" >"$dir/pgbouncer.out" 2>&1 &
pid=$!
read -r _
kill -TERM "$pid"
wait "$pid"
rm -rf "$dir"
`

// EnvBinary names the environment variable that points at another
// pgbouncer binary than the one on PATH: a newer release built from
// source, say.
const EnvBinary = "IDEM_PGBOUNCER"

// Find returns the path of the pgbouncer binary: EnvBinary's, if set,
// else pgbouncer on PATH, else /usr/sbin/pgbouncer; or an error naming
// the command that installs it.
func Find() (string, error) {
	if p := os.Getenv(EnvBinary); p != "" {
		if _, err := os.Stat(p); err != nil {
			return "", fmt.Errorf("%s=%s: %w (unset it for pgbouncer on PATH; install that with: %s)", EnvBinary, p, err, Install)
		}
		return p, nil
	}
	if p, err := exec.LookPath("pgbouncer"); err == nil {
		return p, nil
	}
	const debian = "/usr/sbin/pgbouncer"
	if _, err := os.Stat(debian); err == nil {
		return debian, nil
	}
	return "", fmt.Errorf("pgbouncer is neither on PATH nor at /usr/sbin/pgbouncer (install it: %s)", Install)
}

// Start starts a bouncer as cfg says and returns once it answers a query,
// which it sends on to the server.
func Start(ctx context.Context, cfg Config) (*Bouncer, error) {
	bin, err := Find()
	if err != nil {
		return nil, err
	}
	server, err := pgconn.ParseConfig(cfg.Server)
	if err != nil {
		return nil, fmt.Errorf("pgbouncer: the server's connection string: %w", err)
	}
	ini, err := config(cfg, server)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "pgbouncer-")
	if err != nil {
		return nil, err
	}
	args := []string{dir, bin}
	if os.Geteuid() == 0 {
		owner, err := user.Lookup("postgres")
		if err != nil {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("pgbouncer refuses to run as root, and there is no postgres OS user to run it as: %w", err)
		}
		uid, err1 := strconv.Atoi(owner.Uid)
		gid, err2 := strconv.Atoi(owner.Gid)
		if err := errors.Join(err1, err2, os.Chown(dir, uid, gid)); err != nil {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("pgbouncer: its directory for the postgres OS user: %w", err)
		}
		args = append(args, "-u", "postgres")
	}
	iniPath := filepath.Join(dir, "pgbouncer.ini")
	if err := os.WriteFile(iniPath, []byte(strings.ReplaceAll(ini, "$DIR", dir)), 0o644); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	args = append(args, iniPath)

	cmd := exec.Command("/bin/sh", append([]string{"-c", supervisor, "sh"}, args...)...)
	cmd.SysProcAttr = sysProcAttr()
	alive, err := cmd.StdinPipe()
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("pgbouncer: %w", err)
	}
	b := &Bouncer{dir: dir, port: port, user: server.User, cmd: cmd, alive: alive}
	if err := b.waitReady(ctx); err != nil {
		log := b.log()
		b.Close()
		return nil, fmt.Errorf("pgbouncer did not start: %w; its log: %s", err, log)
	}
	return b, nil
}

// config returns PgBouncer's configuration file, with $DIR for its
// directory.
func config(cfg Config, server *pgconn.Config) (string, error) {
	mode := cfg.PoolMode
	if mode == "" {
		mode = Transaction
	}
	if mode != Session && mode != Transaction {
		return "", fmt.Errorf("pgbouncer: pool mode %q: want %q or %q", mode, Session, Transaction)
	}
	size := cfg.PoolSize
	if size == 0 {
		size = 10
	}
	settings := [][2]string{
		{"host", server.Host},
		{"port", strconv.Itoa(int(server.Port))},
		{"dbname", server.Database},
		{"user", server.User},
		{"password", server.Password},
		{"search_path", cfg.SearchPath},
	}
	for _, s := range settings {
		if strings.ContainsAny(s[1], "'\\\" \t\n") {
			return "", fmt.Errorf("pgbouncer: the %s %q: quotes, backslashes and white space are not supported", s[0], s[1])
		}
	}
	db := []string{"host=" + server.Host, "port=" + strconv.Itoa(int(server.Port)), "dbname=" + server.Database, "user=" + server.User}
	if server.Password != "" {
		db = append(db, "password="+server.Password)
	}
	// In session mode PgBouncer resets a server connection when its
	// client leaves, with DISCARD ALL by default, which would reset the
	// search_path too; the reset below does what DISCARD ALL does that a
	// client of these tests can notice, then sets it again. In transaction
	// mode there is no reset.
	reset := "DISCARD ALL"
	if cfg.SearchPath != "" {
		db = append(db, "connect_query='SET search_path = "+cfg.SearchPath+"'")
		reset = "CLOSE ALL; DEALLOCATE ALL; UNLISTEN *; SELECT pg_advisory_unlock_all(); DISCARD TEMP; RESET ALL; SET search_path = " + cfg.SearchPath
	}
	roundRobin := 0
	if cfg.RoundRobin {
		roundRobin = 1
	}
	extra := ""
	if cfg.MaxPreparedStatements != "" {
		if _, err := strconv.Atoi(cfg.MaxPreparedStatements); err != nil {
			return "", fmt.Errorf("pgbouncer: max_prepared_statements %q: %w", cfg.MaxPreparedStatements, err)
		}
		extra = "max_prepared_statements = " + cfg.MaxPreparedStatements + "\n"
	}
	return fmt.Sprintf(`[databases]
%s = %s

[pgbouncer]
listen_addr =
unix_socket_dir = $DIR
listen_port = %d
auth_type = any
pool_mode = %s
server_reset_query = %s
default_pool_size = %d
max_client_conn = 1000
server_round_robin = %d
server_login_retry = 1
ignore_startup_parameters = extra_float_digits
logfile = $DIR/pgbouncer.log
log_connections = 0
log_disconnections = 0
%s`, Database, strings.Join(db, " "), port, mode, reset, size, roundRobin, extra), nil
}

// URL returns the connection string of the bouncer's database, in the
// keyword=value form: a caller adds settings with a space, such as
// " default_query_exec_mode=exec" or " application_name=x".
func (b *Bouncer) URL() string {
	return fmt.Sprintf("host=%s port=%d dbname=%s user=%s sslmode=disable", b.dir, b.port, Database, b.user)
}

// Close stops the bouncer, which closes its clients' connections, deletes
// its directory and waits for both.
func (b *Bouncer) Close() error {
	b.alive.Close()
	return b.cmd.Wait()
}

// waitReady polls the bouncer with a query until it answers, the context
// is done or startTimeout passes. A bouncer that logged a fatal error
// does not answer.
func (b *Bouncer) waitReady(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	for {
		err := ping(ctx, b.URL())
		if err == nil {
			return nil
		}
		if strings.Contains(b.log(), " FATAL ") {
			return errors.New("a fatal error")
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (last: %v)", ctx.Err(), err)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// ping connects to conn and runs a trivial query.
func ping(ctx context.Context, conn string) error {
	pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	c, err := pgx.Connect(pctx, conn)
	if err != nil {
		return err
	}
	defer c.Close(context.WithoutCancel(ctx))
	_, err = c.Exec(pctx, "SELECT 1")
	return err
}

// log returns what PgBouncer logged, for an error.
func (b *Bouncer) log() string {
	var out []string
	for _, name := range []string{"pgbouncer.out", "pgbouncer.log"} {
		if data, err := os.ReadFile(filepath.Join(b.dir, name)); err == nil && len(data) > 0 {
			out = append(out, strings.TrimSpace(string(data)))
		}
	}
	if len(out) == 0 {
		return "(empty)"
	}
	return strings.Join(out, "\n")
}

// Version returns the version of the pgbouncer binary that [Find] finds,
// as major and minor numbers (1 and 18 for PgBouncer 1.18.0).
func Version() (major, minor int, err error) {
	bin, err := Find()
	if err != nil {
		return 0, 0, err
	}
	out, err := exec.Command(bin, "--version").Output()
	if err != nil {
		return 0, 0, fmt.Errorf("%s --version: %w", bin, err)
	}
	// "PgBouncer 1.18.0\nlibevent ..."
	if _, err := fmt.Sscanf(string(out), "PgBouncer %d.%d", &major, &minor); err != nil {
		return 0, 0, fmt.Errorf("%s --version: %q: %w", bin, strings.SplitN(string(out), "\n", 2)[0], err)
	}
	return major, minor, nil
}

// CanKeepPreparedStatements reports whether the pgbouncer binary that
// [Find] finds can keep prepared statements for its clients in
// transaction mode: PgBouncer 1.21 and later (max_prepared_statements).
func CanKeepPreparedStatements() bool {
	major, minor, err := Version()
	return err == nil && (major > 1 || major == 1 && minor >= 21)
}

// NoPreparedStatements returns the [Config.MaxPreparedStatements] that
// has the binary at hand keep no prepared statement for its clients: "0"
// from PgBouncer 1.21 (from 1.22 it keeps 200 by default), "" before,
// which has no such setting and keeps none.
func NoPreparedStatements() string {
	if CanKeepPreparedStatements() {
		return "0"
	}
	return ""
}
