#!/usr/bin/env bash
# PostgreSQL's CPU per transaction of the order mixes (order-*.sql), counted
# on pgbench's own backends only: the CPU of every backend of the database
# is sampled every 20 ms while pgbench runs, so other work on the same
# PostgreSQL (tests of other checkouts, a load test) does not count, unlike
# run.sh, which counts every PostgreSQL process. The background writers
# (the WAL writer's flushes) are not counted either; every mix here
# commits the same number of times per transaction unless its name says
# "twocommits". It makes a database of its own, IDEM_PGCOST (idem_pgcost),
# with the key table of server/internal/keysql/schema/keys.sql (no open
# keys' index: CreateOpenKeysIndex is opt-in) and bench_orders.
#
#   bench/pgcost/backends.sh [SCRIPT.sql ...]   (default: order-*.sql)
#
# The environment: N (1500 transactions per client), CLIENTS (4), ROUNDS (3).
set -euo pipefail
cd "$(dirname "$0")"
db=${IDEM_PGCOST:-idem_pgcost}
n=${N:-1500}
clients=${CLIENTS:-4}
rounds=${ROUNDS:-3}
[[ $# -gt 0 ]] || set -- order-*.sql
psql=(psql -h 127.0.0.1 -U postgres -X -q -At -v ON_ERROR_STOP=1)
"${psql[@]}" postgres -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db"
"${psql[@]}" "$db" -f ../../server/internal/keysql/schema/keys.sql -c "
CREATE TABLE bench_orders (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    client_id text   NOT NULL,
    customer text    NOT NULL,
    amount   bigint  NOT NULL,
    currency text    NOT NULL
)"
tick=$(getconf CLK_TCK)
# shellcheck source=../pgbench/vars.sh
source ../pgbench/vars.sh
echo "# $(date -u +%FT%TZ), load average $(cut -d' ' -f1-3 /proc/loadavg), N=$n CLIENTS=$clients, pgbench's backends only"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for r in $(seq "$rounds"); do
	for f in "$@"; do
		"${psql[@]}" "$db" -c VACUUM
		declare -A last=()
		pgbench -h 127.0.0.1 -U postgres -n -M prepared -f "$f" -c "$clients" -j 2 -t "$n" "${pgbench_vars[@]}" "$db" >"$out" 2>&1 &
		pb=$!
		while kill -0 "$pb" 2>/dev/null; do
			for p in $(pgrep -f "postgres: .*postgres $db 127.0.0.1"); do
				read -r -a a <"/proc/$p/stat" 2>/dev/null || continue
				last[$p]=$((a[13] + a[14]))
			done
			sleep 0.02
		done
		wait "$pb" || { cat "$out" >&2; exit 1; }
		t=0
		for p in "${!last[@]}"; do t=$((t + last[$p])); done
		printf '%-36s round %d: %4d µs of CPU per transaction; %s\n' "$f" "$r" \
			$((t * 1000000 / tick / (n * clients))) "$(grep -E '^tps' "$out" | cut -d' ' -f1-3)"
		unset last
	done
done
