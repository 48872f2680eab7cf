// Package pgcluster starts throwaway PostgreSQL clusters from the binaries
// on the machine, for tests and test programs: a cluster in a temporary
// directory (initdb, then postgres), and streaming standbys of it
// (pg_basebackup -R) that can be promoted once it is killed:
//
//	primary, err := pgcluster.Start(pgcluster.Config{TCP: true})
//	defer primary.Stop()
//	standby, err := primary.StartStandby(pgcluster.Config{TCP: true})
//	defer standby.Stop()
//	...
//	primary.Kill()             // as its machine dies: SIGKILL, every process
//	err = standby.Promote(ctx) // pg_promote(): the standby is the primary now
//
// A cluster listens on a Unix socket in its own directory, and with
// [Config.TCP] on a free port of 127.0.0.1 too, never on another address.
// It trusts every local connection as the postgres role. The binaries are
// found on PATH, else under /usr/lib/postgresql/*/bin (the newest); as
// root, initdb and postgres refuse to run, so they run as the postgres OS
// user, which then owns the directory.
//
// Each cluster is run by a shell that stops it and deletes its directory as
// soon as its standard input is closed: when [Cluster.Stop] is called, or
// when the process that started it exits, however it exits. Clusters run
// with fsync and full_page_writes off: a process killed, even the
// postmaster with SIGKILL, loses nothing the operating system holds, and
// no test here crashes the machine.
//
// Off Unix, [Start] returns an error.
package pgcluster
