//go:build unix

package pgbouncer

import "syscall"

// sysProcAttr puts the supervisor in a process group of its own: a Ctrl-C
// aimed at go test must not kill it before its cleanup.
func sysProcAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{Setpgid: true} }
