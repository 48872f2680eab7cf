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
