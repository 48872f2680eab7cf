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
		state, ppid, ok := procStat(path)
		if !ok || state == 'Z' || ppid != pid {
			continue
		}
		if p, err := strconv.Atoi(filepath.Base(filepath.Dir(path))); err == nil {
			kids = append(kids, p)
		}
	}
	return kids
}

// alive reports whether process pid runs: it exists and is not a zombie
// (postgres's supervising shell reaps it only at the end).
func alive(pid int) bool {
	state, _, ok := procStat("/proc/" + strconv.Itoa(pid) + "/stat")
	return ok && state != 'Z'
}

// procStat reads the state and the parent's pid of a process from its
// /proc/<pid>/stat, "pid (comm) state ppid ...", whose comm may hold
// spaces and parentheses.
func procStat(path string) (state byte, ppid int, ok bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, 0, false // exited meanwhile
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, false
	}
	fields := bytes.Fields(b[i+1:])
	if len(fields) < 2 || len(fields[0]) != 1 {
		return 0, 0, false
	}
	ppid, err = strconv.Atoi(string(fields[1]))
	return fields[0][0], ppid, err == nil
}
