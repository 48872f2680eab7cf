package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// checkLoopback refuses a URL whose host is not a loopback address: the
// load test drives loopback only.
func checkLoopback(raw string) error {
	u, err := url.Parse(raw)
	if err != nil {
		return fmt.Errorf("%q: %w", raw, err)
	}
	host := u.Hostname()
	if host == "localhost" {
		return nil
	}
	ip := net.ParseIP(host)
	if ip == nil || !ip.IsLoopback() {
		return fmt.Errorf("%q: the load test drives loopback addresses only (127.0.0.1, ::1, localhost)", raw)
	}
	return nil
}

// buildServer builds server/cmd/idem-server of the main module into dir and
// returns the binary's path and its -h text.
func buildServer(ctx context.Context, dir string) (bin, help string, err error) {
	// The bench module replaces github.com/idemkit/idem with "..": go list
	// names the directory of the main module that is actually used.
	out, err := exec.CommandContext(ctx, "go", "list", "-m", "-f", "{{.Dir}}", "github.com/idemkit/idem").Output()
	if err != nil {
		return "", "", fmt.Errorf("finding the main module (run from bench/, or pass -server-url): %w", err)
	}
	root := strings.TrimSpace(string(out))
	bin = filepath.Join(dir, "idem-server")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "./server/cmd/idem-server")
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", "", fmt.Errorf("go build ./server/cmd/idem-server in %s: %w\n%s", root, err, out)
	}
	// -h prints the flags and exits with status 0 (flag.ErrHelp is not an
	// error for main); the text is all that is wanted.
	var buf bytes.Buffer
	h := exec.CommandContext(ctx, bin, "-h")
	h.Stdout, h.Stderr = &buf, &buf
	_ = h.Run()
	return bin, buf.String(), nil
}

// hasFlag reports whether a -h text lists the flag name.
func hasFlag(help, name string) bool {
	for _, line := range strings.Split(help, "\n") {
		f := strings.Fields(line)
		if len(f) > 0 && f[0] == "-"+name {
			return true
		}
	}
	return false
}

// freeAddr returns a loopback address with a port that was free a moment ago.
func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// proc is a started server process.
type proc struct {
	cmd     *exec.Cmd
	url     string
	logPath string
	started time.Time
	exited  chan struct{}
	err     error // valid once exited is closed
}

// startServer starts bin on a free loopback port with args, its output in
// logPath, and waits until /healthz answers 200.
func startServer(ctx context.Context, bin string, args []string, logPath string) (*proc, error) {
	addr, err := freeAddr()
	if err != nil {
		return nil, err
	}
	logf, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	defer logf.Close() // the child keeps its own descriptor
	cmd := exec.Command(bin, append([]string{"-addr", addr}, args...)...)
	cmd.Stdout, cmd.Stderr = logf, logf
	p := &proc{cmd: cmd, url: "http://" + addr, logPath: logPath, exited: make(chan struct{})}
	p.started = time.Now()
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	go func() {
		p.err = cmd.Wait()
		close(p.exited)
	}()
	if err := waitHealthy(ctx, p, 60*time.Second); err != nil {
		p.stop()
		return nil, fmt.Errorf("%w (server log: %s)", err, logPath)
	}
	return p, nil
}

// waitHealthy polls /healthz until it answers 200, the process exits, or
// timeout passes.
func waitHealthy(ctx context.Context, p *proc, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	client := &http.Client{Timeout: time.Second}
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, p.url+"/healthz", nil)
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-p.exited:
			return fmt.Errorf("the server exited before it was healthy: %v", p.err)
		case <-ctx.Done():
			return fmt.Errorf("the server was not healthy within %s: %w", timeout, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// stop stops the process gracefully (SIGTERM), or kills it after 20s.
func (p *proc) stop() error {
	select {
	case <-p.exited:
		return nil
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(20 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.exited
		return errors.New("the server did not stop within 20s of SIGTERM and was killed")
	}
	var ee *exec.ExitError
	if errors.As(p.err, &ee) && ee.ExitCode() != 0 {
		return fmt.Errorf("the server exited with %v (log: %s)", p.err, p.logPath)
	}
	return nil
}

// noTLSOnLoopback returns dsn with sslmode=disable when it sets no sslmode
// (nor PGSSLMODE does) and its host is on loopback or a Unix socket. Every
// server of a run and the load test's own counting connection then talk to
// PostgreSQL in the clear alike: libpq's default, prefer, would negotiate
// TLS wherever the server offers it, and add the cost of encryption to the
// figures of whichever connections did.
func noTLSOnLoopback(dsn string) string {
	if dsn == "" || strings.Contains(dsn, "sslmode") || os.Getenv("PGSSLMODE") != "" {
		return dsn
	}
	cfg, err := pgconn.ParseConfig(dsn)
	if err != nil {
		return dsn // the servers report it
	}
	if ip := net.ParseIP(cfg.Host); cfg.Host != "localhost" && !strings.HasPrefix(cfg.Host, "/") && (ip == nil || !ip.IsLoopback()) {
		return dsn
	}
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		u, err := url.Parse(dsn)
		if err != nil {
			return dsn
		}
		q := u.Query()
		q.Set("sslmode", "disable")
		u.RawQuery = q.Encode()
		return u.String()
	}
	return dsn + " sslmode=disable"
}

// buildBenchServer builds bench/cmd/benchserver into dir and returns the
// binary's path.
func buildBenchServer(ctx context.Context, dir string) (string, error) {
	out, err := exec.CommandContext(ctx, "go", "list", "-m", "-f", "{{.Dir}}", "github.com/idemkit/idem/bench").Output()
	if err != nil {
		return "", fmt.Errorf("finding the bench module (run from bench/): %w", err)
	}
	bin := filepath.Join(dir, "benchserver")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/benchserver")
	cmd.Dir = strings.TrimSpace(string(out))
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/benchserver in %s: %w\n%s", cmd.Dir, err, out)
	}
	return bin, nil
}
