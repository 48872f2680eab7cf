#!/bin/bash
# usage: cpu.sh script.sql -> backend CPU µs per transaction, tps
f=$1
pgbench -h 127.0.0.1 -U postgres -n -M prepared -c 1 -T 12 -f $f idem_bench > /tmp/pgb.out 2>&1 &
sleep 2
pid=$(psql -h 127.0.0.1 -U postgres -d idem_bench -Atc "select pid from pg_stat_activity where application_name='pgbench' and backend_type='client backend' limit 1")
q="select n_tup_ins from pg_stat_user_tables where relname='bench_payments'"
n0=$(psql -h 127.0.0.1 -U postgres -d idem_bench -Atc "select pg_stat_clear_snapshot(); $q" | tail -1)
c0=$(awk '{print $14+$15}' /proc/$pid/stat)
sleep 8
n1=$(psql -h 127.0.0.1 -U postgres -d idem_bench -Atc "$q")
c1=$(awk '{print $14+$15}' /proc/$pid/stat)
wait
echo "$f $(( (c1-c0)*10000*1000/(n1-n0) / 1000 )) us/tx  $(( (n1-n0)/8 )) tx/s"
