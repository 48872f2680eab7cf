//go:build unix

package pgcluster

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// Config says how to start a cluster.
type Config struct {
	// TCP makes the cluster listen on a free port of 127.0.0.1 as well as
	// on its Unix socket. If false, it listens on its socket only, whose
	// name (in the cluster's directory) says port 5432.
	TCP bool
	// Settings are server settings, "name=value", given on postgres's
	// command line (-c name=value) after the package's own (fsync=off,
	// full_page_writes=off), which they override. They are in no
	// configuration file, so a base backup does not copy them into a
	// standby: give a primary's synchronous_standby_names here, never with
	// ALTER SYSTEM before [Cluster.StartStandby], or the standby, once
	// promoted, waits forever for a standby of its own at every commit.
	Settings []string
}

// Cluster is a running throwaway cluster. Its methods are not safe for
// concurrent use.
type Cluster struct {
	dir   string // the temporary directory: data/, the socket, postgres.log
	host  string // 127.0.0.1 with TCP, else dir
	port  int
	pid   int // the postmaster's
	bin   string
	attr  *syscall.SysProcAttr
	cmd   *exec.Cmd      // the supervising shell
	alive io.WriteCloser // its stdin: closing it stops the cluster
}

// socketPort only names the socket file of a cluster without TCP, in the
// cluster's own directory: it cannot collide with anything.
const socketPort = 5432

// readyTimeout bounds how long a cluster may take to accept connections.
const readyTimeout = 60 * time.Second

// supervisor runs postgres in the background, prints its pid, and stops it
// and deletes the directory when stdin reaches EOF. Its arguments are: the
// postgres binary, the directory, the port, listen_addresses, then more
// postgres arguments.
const supervisor = `pg=$1 dir=$2 port=$3 listen=$4
shift 4
"$pg" -D "$dir/data" -k "$dir" -p "$port" -c listen_addresses="$listen" "$@" >>"$dir/postgres.log" 2>&1 &
pid=$!
echo "$pid"
read -r _
kill -INT "$pid" 2>/dev/null
wait "$pid"
rm -rf "$dir"
`

// Available reports why clusters cannot be started here, or nil: the
// binaries are missing, or the process runs as root and there is no
// postgres OS user to run them as.
func Available() error {
	if _, err := findBin(); err != nil {
		return err
	}
	_, _, err := runAs()
	return err
}

// Start makes a new cluster with initdb and starts it.
func Start(cfg Config) (*Cluster, error) {
	return start(cfg, func(c *Cluster) error {
		initdb := exec.Command(filepath.Join(c.bin, "initdb"), "-D", filepath.Join(c.dir, "data"),
			"-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync", "--no-instructions")
		initdb.Dir = c.dir
		initdb.SysProcAttr = c.attr
		if out, err := initdb.CombinedOutput(); err != nil {
			return fmt.Errorf("initdb: %v: %s", err, strings.TrimSpace(string(out)))
		}
		return nil
	})
}

// StartStandby makes a streaming standby of c with pg_basebackup -R (a
// fast checkpoint, the WAL streamed) and starts it. It answers read-only
// queries (hot standby) and replicates asynchronously unless c's
// synchronous_standby_names names it ("*" does). Its primary_conninfo,
// written by pg_basebackup into its postgresql.auto.conf, can be changed
// with ALTER SYSTEM and a reload: set empty, it stops receiving WAL.
func (c *Cluster) StartStandby(cfg Config) (*Cluster, error) {
	return start(cfg, func(s *Cluster) error {
		bb := exec.Command(filepath.Join(s.bin, "pg_basebackup"), "-h", c.host, "-p", strconv.Itoa(c.port), "-U", "postgres",
			"-D", filepath.Join(s.dir, "data"), "-R", "-X", "stream", "--checkpoint=fast", "--no-sync")
		bb.Dir = s.dir
		bb.SysProcAttr = s.attr
		if out, err := bb.CombinedOutput(); err != nil {
			return fmt.Errorf("pg_basebackup: %v: %s", err, strings.TrimSpace(string(out)))
		}
		return nil
	})
}

// errExited says that postgres exited while it started.
var errExited = errors.New("postgres exited")

// start makes a cluster's directory, fills its data directory with
// makeData, and starts postgres on it. With TCP, a postgres that exits at
// start, as it does when another process took the free port meanwhile, is
// given two more tries, each with a new directory and a new port.
func start(cfg Config, makeData func(*Cluster) error) (*Cluster, error) {
	c, err := startOnce(cfg, makeData)
	for try := 1; err != nil && errors.Is(err, errExited) && cfg.TCP && try < 3; try++ {
		c, err = startOnce(cfg, makeData)
	}
	return c, err
}

func startOnce(cfg Config, makeData func(*Cluster) error) (*Cluster, error) {
	bin, err := findBin()
	if err != nil {
		return nil, err
	}
	attr, owner, err := runAs()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "pgcluster-")
	if err != nil {
		return nil, err
	}
	if owner != nil {
		if err := os.Chown(dir, owner[0], owner[1]); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
	}
	c := &Cluster{dir: dir, host: dir, port: socketPort, bin: bin, attr: attr}
	if err := makeData(c); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	listen := ""
	if cfg.TCP {
		if c.port, err = freePort(); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
		c.host, listen = "127.0.0.1", "127.0.0.1"
	}
	args := []string{"-c", supervisor, "sh", filepath.Join(bin, "postgres"), dir, strconv.Itoa(c.port), listen,
		"-c", "fsync=off", "-c", "full_page_writes=off"}
	for _, s := range cfg.Settings {
		args = append(args, "-c", s)
	}
	cmd := exec.Command("/bin/sh", args...)
	cmd.Dir = dir
	sys := *attr
	sys.Setpgid = true // a Ctrl-C aimed at the test must not kill the supervisor before its cleanup
	cmd.SysProcAttr = &sys
	if c.alive, err = cmd.StdinPipe(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("start postgres: %w", err)
	}
	c.cmd = cmd
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if c.pid, _ = strconv.Atoi(strings.TrimSpace(line)); c.pid <= 0 {
		c.Stop()
		return nil, fmt.Errorf("start postgres: no pid from its supervisor (%q, %v)", line, err)
	}
	if err := c.waitReady(readyTimeout); err != nil {
		log, _ := os.ReadFile(c.LogPath())
		c.Stop()
		return nil, fmt.Errorf("postgres did not start: %w: %s", err, strings.TrimSpace(string(log)))
	}
	return c, nil
}

// freePort returns a port of 127.0.0.1 that was free a moment ago.
func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// URL returns the cluster's connection string (keyword/value form) as the
// postgres role, to its postgres database.
func (c *Cluster) URL() string {
	return fmt.Sprintf("host=%s port=%d user=postgres dbname=postgres sslmode=disable", c.host, c.port)
}

// Host returns where the cluster listens: 127.0.0.1 with [Config.TCP],
// else the directory of its socket.
func (c *Cluster) Host() string { return c.host }

// Port returns the cluster's TCP port, or the port its socket is named
// for.
func (c *Cluster) Port() int { return c.port }

// Dir returns the cluster's temporary directory, deleted by [Cluster.Stop].
func (c *Cluster) Dir() string { return c.dir }

// LogPath returns the path of the server's log, in [Cluster.Dir].
func (c *Cluster) LogPath() string { return filepath.Join(c.dir, "postgres.log") }

// Kill kills the cluster as a machine dies: the postmaster is stopped
// (SIGSTOP) so that it starts no process and notices nothing, its children
// (backends, WAL senders, background workers) are killed with SIGKILL, and
// then it is. Nothing is flushed, no client gets an answer, and no standby
// gets another byte of WAL. Off Linux, only the postmaster is killed, and
// its children exit as soon as they notice. The directory stays until
// [Cluster.Stop].
func (c *Cluster) Kill() error {
	if err := syscall.Kill(c.pid, syscall.SIGSTOP); err != nil {
		return fmt.Errorf("stopping the postmaster (pid %d): %w", c.pid, err)
	}
	for _, p := range children(c.pid) {
		syscall.Kill(p, syscall.SIGKILL)
	}
	if err := syscall.Kill(c.pid, syscall.SIGKILL); err != nil {
		return fmt.Errorf("killing the postmaster (pid %d): %w", c.pid, err)
	}
	return nil
}

// Promote ends the recovery of a standby (pg_promote, waiting up to a
// minute): it stops following its primary and accepts writes.
func (c *Cluster) Promote(ctx context.Context) error {
	conn, err := pgx.Connect(ctx, c.URL())
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var done bool
	if err := conn.QueryRow(ctx, "SELECT pg_promote(true, 60)").Scan(&done); err != nil {
		return fmt.Errorf("pg_promote: %w", err)
	}
	if !done {
		return errors.New("pg_promote: the standby was not promoted within 60s")
	}
	return nil
}

// Stop shuts the cluster down (fast shutdown; nothing to do if it was
// killed), deletes its directory and waits for both.
func (c *Cluster) Stop() error {
	c.alive.Close()
	return c.cmd.Wait()
}

// waitReady polls the cluster until it answers, its postmaster dies, or
// the timeout passes.
func (c *Cluster) waitReady(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := ping(ctx, c.URL())
		cancel()
		switch {
		case err == nil:
			return nil
		case !alive(c.pid):
			return fmt.Errorf("%w (%v)", errExited, err)
		case time.Now().After(deadline):
			return err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// ping connects to conn once and runs a trivial query.
func ping(ctx context.Context, conn string) error {
	c, err := pgx.Connect(ctx, conn)
	if err != nil {
		return err
	}
	defer c.Close(context.WithoutCancel(ctx))
	_, err = c.Exec(ctx, "SELECT 1")
	return err
}

// findBin returns the directory of initdb, postgres and pg_basebackup: the
// one initdb on PATH is in (a symbolic link followed to its target, as
// Debian's /usr/bin/initdb), else the newest under /usr/lib/postgresql.
func findBin() (string, error) {
	if p, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			p = real
		}
		return filepath.Dir(p), nil
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	slices.SortFunc(dirs, func(a, b string) int { return versionOf(b) - versionOf(a) })
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d, nil
		}
	}
	return "", errors.New("initdb is neither on PATH nor under /usr/lib/postgresql/*/bin")
}

// versionOf reads the major version out of /usr/lib/postgresql/<v>/bin.
func versionOf(binDir string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(binDir)))
	return v
}

// runAs returns how to run initdb and postgres, which refuse to run as root:
// as root, they run as the postgres OS user, which must then own the
// directory (owner holds its uid and gid).
func runAs() (attr *syscall.SysProcAttr, owner []int, err error) {
	if os.Geteuid() != 0 {
		return &syscall.SysProcAttr{}, nil, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, nil, fmt.Errorf("running as root, and initdb refuses root: no postgres OS user to run it as (%v)", err)
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
	gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
	if err := errors.Join(err1, err2); err != nil {
		return nil, nil, fmt.Errorf("postgres OS user: %w", err)
	}
	attr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}}
	return attr, []int{int(uid), int(gid)}, nil
}
