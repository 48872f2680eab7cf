//go:build unix && !linux

package pgcluster

import "syscall"

// children returns nothing off Linux: a postmaster's children exit by
// themselves once they notice it died.
func children(pid int) []int { return nil }

// alive reports whether process pid exists; a zombie counts as alive.
func alive(pid int) bool { return syscall.Kill(pid, 0) == nil }
