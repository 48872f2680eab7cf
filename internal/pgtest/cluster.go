//go:build unix

package pgtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// clusterPort only names the socket file in the cluster's own directory:
// the cluster listens on no TCP port, so it cannot collide with anything.
const clusterPort = 5432

// The cluster started by [startCluster] for this process. It is referenced
// here so the pipe that keeps it alive is never closed by a finalizer.
var fallback *cluster

// startCluster starts this process's throwaway cluster and returns its
// connection string. It is called at most once, by discover.
func startCluster() (string, error) {
	c, err := newCluster()
	if err != nil {
		return "", err
	}
	fallback = c
	return fallback.url, nil
}

// cluster is a PostgreSQL cluster in a temporary directory, run by a shell
// that stops it and deletes the directory as soon as its standard input is
// closed: when stop is called or when this process exits, even by a signal.
type cluster struct {
	url   string
	dir   string
	cmd   *exec.Cmd
	alive io.WriteCloser // the shell's stdin
}

// supervisor runs postgres in the background and waits for EOF on stdin.
// Its arguments are: the postgres binary, the directory, the port.
const supervisor = `"$1" -D "$2/data" -k "$2" -p "$3" -c listen_addresses= -c fsync=off -c full_page_writes=off >"$2/postgres.log" 2>&1 &
pid=$!
read -r _
kill -INT "$pid"
wait "$pid"
rm -rf "$2"
`

func newCluster() (*cluster, error) {
	bin, err := findBin()
	if err != nil {
		return nil, err
	}
	attr, owner, err := runAs()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "pgtest-")
	if err != nil {
		return nil, err
	}
	if owner != nil {
		if err := os.Chown(dir, owner[0], owner[1]); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
	}

	initdb := exec.Command(filepath.Join(bin, "initdb"), "-D", filepath.Join(dir, "data"),
		"-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync", "--no-instructions")
	initdb.Dir = dir
	initdb.SysProcAttr = attr
	if out, err := initdb.CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("initdb: %v: %s", err, strings.TrimSpace(string(out)))
	}

	cmd := exec.Command("/bin/sh", "-c", supervisor, "sh", filepath.Join(bin, "postgres"), dir, strconv.Itoa(clusterPort))
	cmd.Dir = dir
	sys := *attr
	sys.Setpgid = true // a Ctrl-C aimed at go test must not kill the supervisor before its cleanup
	cmd.SysProcAttr = &sys
	alive, err := cmd.StdinPipe()
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("start postgres: %w", err)
	}
	c := &cluster{
		url:   fmt.Sprintf("host=%s port=%d user=postgres dbname=postgres sslmode=disable", dir, clusterPort),
		dir:   dir,
		cmd:   cmd,
		alive: alive,
	}
	if err := c.waitReady(30 * time.Second); err != nil {
		log, _ := os.ReadFile(filepath.Join(dir, "postgres.log"))
		c.stop()
		return nil, fmt.Errorf("postgres did not start: %v: %s", err, strings.TrimSpace(string(log)))
	}
	return c, nil
}

// waitReady polls the cluster until it answers or the timeout passes.
func (c *cluster) waitReady(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := ping(ctx, c.url)
		cancel()
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// stop shuts the cluster down, deletes its directory and waits for both.
func (c *cluster) stop() error {
	c.alive.Close()
	return c.cmd.Wait()
}

// findBin returns the directory of initdb and postgres: the one on PATH, else
// the newest under /usr/lib/postgresql.
func findBin() (string, error) {
	if p, err := exec.LookPath("initdb"); err == nil {
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
