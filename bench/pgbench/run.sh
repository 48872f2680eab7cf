#!/usr/bin/env bash
# Runs the SQL of one first execution of the reference server (first.sql)
# with pgbench: the physical limit of the
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
[[ -f $script ]] || { echo "run.sh: no script $script (SCRIPT: first or unkeyed)" >&2; exit 2; }
pgbench=$(command -v pgbench || ls /usr/lib/postgresql/*/bin/pgbench | tail -1)

# shellcheck source=vars.sh
source "$dir/vars.sh"
exec "$pgbench" "$url" -n -M prepared -c "$conc" -j 2 -T "$secs" -f "$script" "${pgbench_vars[@]}"
