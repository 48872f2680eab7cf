package main

import "syscall"

// sysProcAttr makes the kernel kill a replica with SIGKILL when the chaos
// process dies, however it dies, so no server outlives the run.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
