package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// startTimeout bounds how long a replica may take to start listening.
const startTimeout = 60 * time.Second

// buildServer builds the idem-server binary into dir and returns its path.
// The module is found from the working directory, which must be inside it.
func buildServer(ctx context.Context, dir string) (string, error) {
	bin := filepath.Join(dir, "idem-server")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "github.com/idemkit/idem/server/cmd/idem-server")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build idem-server (run from the idem module, or pass -server-bin): %v: %s", err, strings.TrimSpace(string(out)))
	}
	return bin, nil
}

// replica is one idem-server process, which can be killed and started
// again. Its methods are not safe for concurrent use: one goroutine manages
// each replica at a time.
type replica struct {
	n       int
	appName string // application_name of its PostgreSQL connections
	bin     string
	args    []string         // without -addr
	logPath string           // stdout and stderr of every start, appended
	onLog   func(msg string) // called with the message of every JSON log record

	cmd    *exec.Cmd
	addr   string
	exited chan struct{} // closed once the process is reaped
	starts int
}

// start starts the process on a free loopback port and waits until it
// listens; it returns the address.
func (r *replica) start(ctx context.Context) (string, error) {
	logf, err := os.OpenFile(r.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return "", err
	}
	r.starts++
	fmt.Fprintf(logf, "--- chaos: start %d of replica %d\n", r.starts, r.n)
	cmd := exec.Command(r.bin, append([]string{"-addr", "127.0.0.1:0"}, r.args...)...)
	cmd.Stderr = logf
	cmd.SysProcAttr = sysProcAttr()
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		logf.Close()
		return "", err
	}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return "", fmt.Errorf("replica %d: %w", r.n, err)
	}
	r.cmd = cmd
	exited := make(chan struct{})
	r.exited = exited
	listening := make(chan string, 1)
	// The reaper copies the logs and, at the end of stdout (the process
	// died or stopped), waits for the process.
	go func() {
		defer close(exited)
		defer logf.Close()
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		found := false
		for sc.Scan() {
			line := sc.Bytes()
			logf.Write(append(line, '\n'))
			var rec struct{ Msg, Addr string }
			if json.Unmarshal(line, &rec) != nil {
				continue
			}
			if r.onLog != nil {
				r.onLog(rec.Msg)
			}
			if !found && rec.Msg == "listening" && rec.Addr != "" {
				found = true
				listening <- rec.Addr
			}
		}
		cmd.Wait()
	}()
	t := time.NewTimer(startTimeout)
	defer t.Stop()
	select {
	case addr := <-listening:
		r.addr = addr
		return addr, nil
	case <-exited:
		return "", fmt.Errorf("replica %d exited at start (%v); see %s", r.n, cmd.ProcessState, r.logPath)
	case <-t.C:
		r.kill()
		return "", fmt.Errorf("replica %d did not listen within %s; see %s", r.n, startTimeout, r.logPath)
	case <-ctx.Done():
		r.kill()
		return "", ctx.Err()
	}
}

// pid returns the process id of the running process.
func (r *replica) pid() int {
	if r.cmd == nil || r.cmd.Process == nil {
		return 0
	}
	return r.cmd.Process.Pid
}

// kill kills the process with SIGKILL and waits until it is reaped.
func (r *replica) kill() {
	if r.cmd == nil {
		return
	}
	r.cmd.Process.Signal(syscall.SIGKILL)
	<-r.exited
	r.cmd = nil
}

// stop stops the process gracefully (SIGTERM), or with SIGKILL after
// timeout.
func (r *replica) stop(timeout time.Duration) error {
	if r.cmd == nil {
		return nil
	}
	r.cmd.Process.Signal(syscall.SIGTERM)
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-r.exited:
		state := r.cmd.ProcessState
		r.cmd = nil
		if state != nil && !state.Success() {
			return fmt.Errorf("replica %d stopped with %v; see %s", r.n, state, r.logPath)
		}
		return nil
	case <-t.C:
		r.kill()
		return fmt.Errorf("replica %d did not stop within %s of SIGTERM and was killed", r.n, timeout)
	}
}

// fleet is the set of replicas and the goroutine-safe view of them.
type fleet struct {
	mu       sync.Mutex // held while a replica is killed or started
	replicas []*replica

	logMu sync.Mutex
	logs  map[string]int64 // log records of every replica, by message
}

// countLog counts a log record of a replica.
func (f *fleet) countLog(msg string) {
	f.logMu.Lock()
	f.logs[msg]++
	f.logMu.Unlock()
}

// logCounts returns a copy of the log record counts.
func (f *fleet) logCounts() map[string]int64 {
	f.logMu.Lock()
	defer f.logMu.Unlock()
	return maps.Clone(f.logs)
}

// startAll starts every replica and returns their addresses, in order.
func (f *fleet) startAll(ctx context.Context) ([]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var addrs []string
	for _, r := range f.replicas {
		addr, err := r.start(ctx)
		if err != nil {
			return nil, err
		}
		addrs = append(addrs, addr)
	}
	return addrs, nil
}

// stopAll stops every replica gracefully, in parallel.
func (f *fleet) stopAll(timeout time.Duration) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	errs := make([]error, len(f.replicas))
	var wg sync.WaitGroup
	for i, r := range f.replicas {
		wg.Go(func() { errs[i] = r.stop(timeout) })
	}
	wg.Wait()
	return errors.Join(errs...)
}
