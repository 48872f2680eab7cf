#!/usr/bin/env bash
# qcost.sh N VARIANTS... : backend instructions per statement (or, for the
# tx* variants, per one-transaction first execution) under callgrind, on a
# throwaway cluster, one connection. Build its driver first, from the
# repository's root (it reads keysql's statements, which are internal):
#   mkdir -p server/internal/zzqcost && cp bench/results/pgcost-ninth/qcost.go.txt server/internal/zzqcost/main.go
#   go build -o /tmp/qcost ./server/internal/zzqcost && rm -r server/internal/zzqcost
# then, as root (the cluster runs as postgres):
#   bench/results/pgcost-ninth/qcost.sh 1000 read peek1 peek8 peek
#   bench/results/pgcost-ninth/qcost.sh 1000 txplain txplainret txgate txcte1 txcte txgateagg txagg
set -euo pipefail
n=$1; shift
bindir=$(pg_config --bindir)
work=$(mktemp -d /tmp/qcost.XXXXXX); chmod 755 $work; chown postgres $work
as_pg=(runuser -u postgres --)
cleanup() { "${as_pg[@]}" "$bindir/pg_ctl" -D "$work/data" -m immediate stop >/dev/null 2>&1 || true; sleep 2; rm -rf $work; }
trap cleanup EXIT
"${as_pg[@]}" "$bindir/initdb" -D "$work/data" -A trust -U postgres >/dev/null
port=$((20000 + RANDOM % 20000))
# setup without callgrind first
"${as_pg[@]}" "$bindir/pg_ctl" -D $work/data -o "-p $port -k $work -c listen_addresses= -c fsync=off" -l $work/pg0.log start >/dev/null
url="postgres://postgres@/postgres?host=$work&port=$port"
/tmp/qcost -url "$url" -setup
"${as_pg[@]}" "$bindir/pg_ctl" -D $work/data -m fast stop >/dev/null
"${as_pg[@]}" bash -c "valgrind --tool=callgrind --callgrind-out-file=$work/backend.%p $bindir/postgres -D $work/data -p $port -k $work -c listen_addresses= -c fsync=off -c autovacuum=off >$work/postgres.log 2>&1 &"
for _ in $(seq 120); do "$bindir/pg_isready" -q -h "$work" -p "$port" && break; sleep 1; done
total() { grep -E '^(summary|totals):' "$1" | head -1 | awk '{print $2}'; }
count() {
  /tmp/qcost -url "$url" -v $1 -n $2 2>$work/q.log || { cat $work/q.log; exit 1; }
  pid=$(awk '$1=="backend"{print $2}' $work/q.log)
  for _ in $(seq 60); do [ -s "$work/backend.$pid" ] && grep -qE '^(summary|totals):' "$work/backend.$pid" && break; sleep 1; done
  mkdir -p /tmp/qcost-out; cp $work/backend.$pid /tmp/qcost-out/$1.$2; total $work/backend.$pid
}
for v in "$@"; do
  a=$(count $v 50); b=$(count $v $((50+n)))
  printf '%-10s %10d\n' $v $(((b-a)/n))
done
