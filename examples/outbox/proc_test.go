package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"
)

// childEnv, set to 1, makes the test binary run as the outbox command
// (see TestMain): the chaos test starts its services and workers that way,
// so that it can kill real processes without building another binary.
const childEnv = "OUTBOX_TEST_MAIN"

// readyTimeout bounds how long a process may take to start.
const readyTimeout = 30 * time.Second

// proc is one outbox process (a service or a worker), which the test
// starts, kills with SIGKILL and starts again. Its methods are not safe for
// concurrent use: one goroutine drives each proc.
type proc struct {
	name    string
	args    []string
	ready   string // the log message that says it is up
	logPath string // its stdout and stderr, every start appended

	cmd    *exec.Cmd
	exited chan struct{} // closed once the process is reaped
	addr   string        // the "addr" of its ready record, if any
	starts int
}

// start starts the process and waits for its ready record.
func (p *proc) start() error {
	if p.cmd != nil {
		return fmt.Errorf("%s is already running", p.name)
	}
	logf, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	p.starts++
	fmt.Fprintf(logf, "--- test: start %d of %s\n", p.starts, p.name)
	cmd := exec.Command(os.Args[0], p.args...)
	cmd.Env = append(os.Environ(), childEnv+"=1")
	cmd.Stderr = logf
	cmd.SysProcAttr = sysProcAttr()
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		logf.Close()
		return err
	}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("%s: %w", p.name, err)
	}
	p.cmd = cmd
	exited := make(chan struct{})
	p.exited = exited
	ready := make(chan string, 1)
	go func() { // copies the log; at its end (the process died), reaps the process
		defer close(exited)
		defer logf.Close()
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			logf.Write(append(sc.Bytes(), '\n'))
			var rec struct{ Msg, Addr string }
			if json.Unmarshal(sc.Bytes(), &rec) == nil && rec.Msg == p.ready {
				select {
				case ready <- rec.Addr:
				default:
				}
			}
		}
		cmd.Wait()
	}()
	t := time.NewTimer(readyTimeout)
	defer t.Stop()
	select {
	case p.addr = <-ready:
		return nil
	case <-exited:
		return fmt.Errorf("%s exited at start (%v); see %s", p.name, cmd.ProcessState, p.logPath)
	case <-t.C:
		p.kill()
		return fmt.Errorf("%s did not start within %s; see %s", p.name, readyTimeout, p.logPath)
	}
}

// kill kills the process with SIGKILL, if it runs, and waits until it is
// reaped.
func (p *proc) kill() {
	if p.cmd == nil {
		return
	}
	p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.exited
	p.cmd = nil
}

// logTail returns the last n lines of the process's log.
func (p *proc) logTail(n int) string {
	b, _ := os.ReadFile(p.logPath)
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	return strings.Join(lines[max(len(lines)-n, 0):], "\n")
}
