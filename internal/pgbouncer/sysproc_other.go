//go:build !unix

package pgbouncer

import "syscall"

// sysProcAttr: no process group of its own off Unix.
func sysProcAttr() *syscall.SysProcAttr { return nil }
