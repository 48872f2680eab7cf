#!/usr/bin/env bash
# Counts the instructions per request of the bench server's ways on the
# server side: its one PostgreSQL backend's and the server process's own,
# with valgrind's callgrind, which, unlike time, does not move with the
# load of a shared machine (the load test's ratios do, by ±5% between runs
# of the same code).
#
#   HANDLER=payments ONETX= bench/backend-instructions.sh [N] [WAYS...]
#   (defaults: 500; first article unkeyed replay read)
#
# It starts a throwaway PostgreSQL cluster under callgrind (initdb from
# pg_config --bindir; fsync off, as the count has no use for it), then
# runs, for each way, benchserver -drive WAY (cmd/benchserver/drive.go:
# the way's requests served in process, without a listener or the
# payments' processor) under callgrind too, with 50 and 50+N requests on
# one connection, each run on emptied tables. The difference of the two
# runs' totals divided by N is one request's cost, with the start-up and
# the migration cancelled out (a first run creates the tables). Payments call no processor: its round trip
# is the same for every way. ONETX=1 serves idem's route in one
# transaction. The binary is built with CGO_ENABLED=0 and runs with
# GOMAXPROCS=1 and GODEBUG=asyncpreemptoff=1,cpu.rdtscp=off (see
# instructions.sh). A way takes a minute or two.
set -euo pipefail
cd "$(dirname "$0")"
n=${1:-500}
shift || true
ways=("$@")
[ ${#ways[@]} -gt 0 ] || ways=(first article unkeyed replay read)
handler=${HANDLER:-payments}
bindir=$(pg_config --bindir)
work=$(mktemp -d /tmp/backend-instructions.XXXXXX)
chmod 755 "$work"
as_pg=()
if [ "$(id -u)" = 0 ]; then as_pg=(runuser -u postgres --); chown postgres "$work"; fi
cleanup() {
	"${as_pg[@]}" "$bindir/pg_ctl" -D "$work/data" -m immediate stop >/dev/null 2>&1 || true
	for _ in 1 2 3 4 5; do # the backends' callgrind files are written as they die
		rm -rf "$work" 2>/dev/null && break
		sleep 1
	done
}
trap cleanup EXIT
CGO_ENABLED=0 go build -o "$work/benchserver" ./cmd/benchserver
"${as_pg[@]}" "$bindir/initdb" -D "$work/data" -A trust -U postgres >/dev/null
port=$((20000 + RANDOM % 20000))
"${as_pg[@]}" bash -c "valgrind --tool=callgrind --callgrind-out-file=$work/backend.%p \
	$bindir/postgres -D $work/data -p $port -k $work -c listen_addresses= \
	-c fsync=off -c autovacuum=off >$work/postgres.log 2>&1 &"
url="postgres://postgres@/postgres?host=$work&port=$port"
for _ in $(seq 120); do
	"$bindir/pg_isready" -q -h "$work" -p "$port" && break
	sleep 1
done
flags=(-database-url "$url" -handler "$handler" -reset -db-max-conns 1)
[ -n "${ONETX:-}" ] && flags+=(-one-transaction)
total() { grep -E '^(summary|totals):' "$1" | head -1 | awk '{print $2}'; }
# count WAY REQUESTS prints the backend's and the server's instructions.
count() {
	GOMAXPROCS=1 GODEBUG=asyncpreemptoff=1,cpu.rdtscp=off valgrind --tool=callgrind \
		--callgrind-out-file="$work/server.out" "$work/benchserver" "${flags[@]}" -drive "$1" -requests "$2" \
		2>"$work/server.log" || { cat "$work/server.log" >&2; exit 1; }
	pid=$(awk '$1 == "backend" {print $2}' "$work/server.log")
	for _ in $(seq 60); do # the backend writes its counts when it exits
		[ -s "$work/backend.$pid" ] && grep -qE '^(summary|totals):' "$work/backend.$pid" && break
		sleep 1
	done
	echo "$(total "$work/backend.$pid") $(total "$work/server.out")"
}
count first 1 >/dev/null # creates the tables, which the counted runs then only empty
printf '%-8s %-9s %12s %12s\n' handler way backend server
for way in "${ways[@]}"; do
	read -r b0 s0 < <(count "$way" 50)
	read -r b1 s1 < <(count "$way" $((50 + n)))
	printf '%-8s %-9s %12d %12d\n' "$handler${ONETX:+/1tx}" "$way" $(((b1 - b0) / n)) $(((s1 - s0) / n))
done
