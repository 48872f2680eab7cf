#!/usr/bin/env bash
# Runs the SQL of one first execution of the reference server (first.sql,
# or first-async.sql with ASYNC=1) with pgbench: the physical limit of the
# "first" scenario of cmd/loadtest on the same database and concurrency.
# SCRIPT=unkeyed runs unkeyed.sql instead, the SQL of the "unkeyed"
# scenario; ratio.sh compares the two.
#
#   bench/pgbench/run.sh [DATABASE_URL] [CONCURRENCY] [DURATION_SECONDS]
#
# The schema must be there: run the load test (or idem-server) on the same
# database once first. pgbench's own client runs on the same machine, as
# the load test's does. The rows it adds belong to client 'pgbench'.
set -euo pipefail
url=${1:-${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/idem_bench}}
conc=${2:-8}
secs=${3:-10}
dir=$(cd "$(dirname "$0")" && pwd)
script=$dir/${SCRIPT:-first}.sql
if [[ ${ASYNC:-0} == 1 ]]; then script=$dir/first-async.sql; fi
[[ -f $script ]] || { echo "run.sh: no script $script (SCRIPT: first, first-async or unkeyed)" >&2; exit 2; }
pgbench=$(command -v pgbench || ls /usr/lib/postgresql/*/bin/pgbench | tail -1)

# The values the server sends for a demo payment (see server/postgres.go).
# fp is a SHA-256, as bytea hex input.
exec "$pgbench" "$url" -n -M prepared -c "$conc" -j 2 -T "$secs" -f "$script" \
	-D client=pgbench -D method=POST -D path=/v1/payments \
	-D 'fp=\x9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08' \
	-D fpver=1 -D lockus=30000000 -D retus=86400000000 \
	-D status=201 -D ctype=application/json \
	-D 'hdr={"Location": "/v1/payments/pay_b5ad45db40c10415a7d143db"}' \
	-D 'body={"id":"pay_b5ad45db40c10415a7d143db","object":"payment","amount":4200,"currency":"usd","customer":"cus_123","charge":"ch_0d1c8f4f8e2b4a6f9c3d2e1f0a9b8c7d","created":"2026-01-01T00:00:00Z"}' \
	-D customer=cus_123 -D currency=usd
