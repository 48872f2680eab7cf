#!/usr/bin/env bash
# The database's own (a)/(c): pgbench's transactions per second for the SQL
# of a keyed first execution (first.sql: claim, charge, completion with the
# payment) against the SQL of the same payment without the idempotency
# layer (unkeyed.sql: charge, payment), in ROUNDS alternating runs at the
# same concurrency on the same database. No HTTP, no Go, no JSON: what the
# statements cost PostgreSQL (and libpq's client) on this machine.
#
#   bench/pgbench/ratio.sh [DATABASE_URL] [CONCURRENCY] [DURATION_SECONDS] [ROUNDS]
set -euo pipefail
url=${1:-${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/idem_bench}}
conc=${2:-8}
secs=${3:-10}
rounds=${4:-3}
dir=$(cd "$(dirname "$0")" && pwd)
tps() { SCRIPT=$1 "$dir/run.sh" "$url" "$conc" "$secs" | awk '/^tps = /{print $3}'; }
printf '%-6s %12s %12s %7s\n' round first_tps unkeyed_tps ratio
for i in $(seq "$rounds"); do
	a=$(tps first)
	c=$(tps unkeyed)
	awk -v i="$i" -v a="$a" -v c="$c" 'BEGIN { printf "%-6s %12.1f %12.1f %7.2f\n", i, a, c, a / c }'
done
