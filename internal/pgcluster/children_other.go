//go:build unix && !linux

package pgcluster

// children returns nothing off Linux: a postmaster's children exit by
// themselves once they notice it died.
func children(pid int) []int { return nil }
