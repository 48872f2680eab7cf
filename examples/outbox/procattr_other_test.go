//go:build !linux

package main

import "syscall"

// sysProcAttr is nil where there is no parent-death signal: the test's
// cleanup kills its children.
func sysProcAttr() *syscall.SysProcAttr { return nil }
