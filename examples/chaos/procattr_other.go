//go:build !linux

package main

import "syscall"

// sysProcAttr returns nil off Linux, which has no parent-death signal: a
// replica outlives a chaos process that is itself killed with SIGKILL.
func sysProcAttr() *syscall.SysProcAttr { return nil }
