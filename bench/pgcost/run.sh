#!/usr/bin/env bash
# PostgreSQL's CPU per transaction of each statement mix of issue 11,
# without HTTP or Go in the way: pgbench runs each script for N
# transactions per client (-M prepared, as pgx prepares), and the CPU time
# of every PostgreSQL process over the run (utime and stime from /proc,
# the exited backends' included through the postmaster's cutime and
# cstime) is divided by the transactions. CPU time, unlike a rate, hardly
# moves with the other load on a shared machine.
#
#   bench/pgcost/run.sh [SCRIPT.sql ...]     (default: all of them)
#
# The environment: DATABASE (idem_bench; migrated by a load test run, which
# creates idempotency_keys, payments and charges), N (1500 transactions
# per client), CLIENTS (4), ROUNDS (2), PGOPTIONS (e.g. "-c
# synchronous_commit=off" to leave the WAL flushes out). Run on the
# machine where PostgreSQL runs, as a user that can read its /proc.
#
# Any pgbench script runs, with the variables bench/pgbench/run.sh sets, so
# the mixes of the server as it is now are ../pgbench/first.sql and
# ../pgbench/unkeyed.sql (generated from the server's SQL, and checked for
# drift by TestPgbenchScripts). The scripts here are snapshots: the
# statements of pgstore and of the reference server, with their parameters
# written in as literals, as they were when BENCHMARKS.md's table ("Issue
# 11", "PostgreSQL's CPU per statement") was measured with them; each is
# one transaction mix:
#   select1             SELECT 1: a round trip and nothing else
#   charge              the fake processor's charge: one INSERT, committed
#   unkeyed             the unkeyed request: charge; BEGIN; payment INSERT; COMMIT
#   claim               claimSQL alone, for a new key
#   claimnew            claimNewSQL alone, for a new key (what Claim runs first)
#   claim-bare-insert   a plain INSERT … ON CONFLICT DO NOTHING of a key row: a floor
#   keyed               a first execution with claimSQL: claim; charge; BEGIN;
#                       payment INSERT; completion; COMMIT
#   keyed-claimnew      the same with claimNewSQL
#   keyed-hot           the same with claimSQL and a completion that leaves
#                       expires_at alone (HOT when the page has room)
set -euo pipefail
cd "$(dirname "$0")"
db=${DATABASE:-idem_bench}
n=${N:-1500}
clients=${CLIENTS:-4}
rounds=${ROUNDS:-2}
[[ $# -gt 0 ]] || set -- select1.sql charge.sql unkeyed.sql claim.sql claimnew.sql claim-bare-insert.sql keyed.sql keyed-claimnew.sql keyed-hot.sql
psql=(psql -h 127.0.0.1 -U postgres -X -q -At -v ON_ERROR_STOP=1 "$db")
"${psql[@]}" -c "SELECT 'idempotency_keys'::regclass, 'payments'::regclass, 'charges'::regclass" >/dev/null ||
	{ echo "pgcost: $db lacks the tables: run the load test against it once" >&2; exit 1; }
pm=$(head -1 "$("${psql[@]}" -c 'SHOW data_directory')/postmaster.pid")
tick=$(getconf CLK_TCK)
# total: CPU ticks of the postmaster, its children, and its exited children.
total() {
	local t=0 p a
	for p in $(pgrep -P "$pm") "$pm"; do
		read -r -a a < "/proc/$p/stat" 2>/dev/null || continue
		t=$((t + a[13] + a[14] + a[15] + a[16]))
	done
	echo "$t"
}
# shellcheck source=../pgbench/vars.sh
source ../pgbench/vars.sh
echo "# $(date -u +%FT%TZ), load average $(cut -d' ' -f1-3 /proc/loadavg), N=$n CLIENTS=$clients PGOPTIONS=${PGOPTIONS:-}"
for r in $(seq "$rounds"); do
	for f in "$@"; do
		"${psql[@]}" -c VACUUM
		b=$(total)
		out=$(pgbench -h 127.0.0.1 -U postgres -n -M prepared -f "$f" -c "$clients" -j 2 -t "$n" "${pgbench_vars[@]}" "$db" 2>&1) ||
			{ echo "$out" >&2; exit 1; }
		sleep 0.5 # for the exited backends to be reaped
		a=$(total)
		printf '%-24s round %d: %4d µs of PostgreSQL CPU per transaction; %s\n' "$f" "$r" \
			$(((a - b) * 1000000 / tick / (n * clients))) "$(grep -E '^tps' <<< "$out" | cut -d' ' -f1-3)"
	done
done
