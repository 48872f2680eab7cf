package pgcluster

import (
	"bytes"
	"os"
	"path/filepath"
	"strconv"
)

// children returns the processes whose parent is pid, read from /proc.
func children(pid int) []int {
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	var kids []int
	for _, path := range stats {
		b, err := os.ReadFile(path)
		if err != nil {
			continue // exited meanwhile
		}
		// "pid (comm) state ppid ...": comm may hold spaces and parentheses.
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		fields := bytes.Fields(b[i+1:])
		if len(fields) < 2 {
			continue
		}
		if ppid, _ := strconv.Atoi(string(fields[1])); ppid == pid {
			if p, err := strconv.Atoi(filepath.Base(filepath.Dir(path))); err == nil {
				kids = append(kids, p)
			}
		}
	}
	return kids
}
