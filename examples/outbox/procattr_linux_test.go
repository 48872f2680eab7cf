package main

import "syscall"

// sysProcAttr makes the kernel kill a child with SIGKILL when the test
// process dies, however it dies, so that no service or worker outlives it.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
