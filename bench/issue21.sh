#!/usr/bin/env bash
# Issue 21's comparison: idem, the seed article by hand and the handler
# unkeyed, on the bench server (bench/cmd/benchserver), in interleaved
# rounds at concurrency 8 and 16, for the orders handler in one-transaction
# mode and the payments handler on two commits. One JSON line per scenario
# and round in results/issue21-<handler>-c<N>.jsonl, the ratios in the
# .txt beside it.
#
#   cd bench && ./issue21.sh [rounds] [duration]
set -euo pipefail
cd "$(dirname "$0")"
rounds=${1:-6}
duration=${2:-8s}
db=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/idem_bench}
psql "${db%/*}/postgres" -qc "CREATE DATABASE ${db##*/}" 2>/dev/null || true
go build -o /tmp/idem-loadtest ./cmd/loadtest
for c in 8 16; do
	for h in orders payments; do
		extra=()
		[ "$h" = orders ] && extra=(-one-transaction)
		out=results/issue21-$h-c$c
		/tmp/idem-loadtest -database-url "$db" -handler "$h" "${extra[@]}" -concurrency "$c" \
			-scenario first,article,unkeyed,replay -rounds "$rounds" -duration "$duration" -json \
			>"$out.jsonl" 2>"$out.txt"
		echo "== $h c$c"; grep -E "^(ratio|CPU)" "$out.txt"
	done
done
