#!/usr/bin/env bash
# Time-partitioned key table vs batched DELETE: see README.md.
#
#   bench/partition/run.sh DATABASE_URL [check|hot|retention|all] [REPEATS]
#
# The database must hold the server's schema (run idem-server on it once)
# and be yours alone: every step TRUNCATEs idempotency_keys, payments and
# charges and recreates schema part. Raw output goes to
# bench/results/partition-<step>.txt.
set -euo pipefail
url=${1:?DATABASE_URL}
what=${2:-all}
reps=${3:-2}
dir=$(cd "$(dirname "$0")" && pwd)
res=$dir/../results
pgbench=$(command -v pgbench || ls /usr/lib/postgresql/*/bin/pgbench | tail -1)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
psqlq() { psql "$url" -v ON_ERROR_STOP=1 -qAtX "$@"; }
now() { date +%s.%N; }
conc=8

# The variables of bench/pgbench/run.sh.
# shellcheck source=../pgbench/vars.sh
source "$dir/../pgbench/vars.sh"
dvars=("${pgbench_vars[@]}")

# first-part.sql: bench/pgbench/first.sql with the claim replaced by
# part.claim() and the completion's UPDATE on part.idempotency_keys; the
# charge and the rest of the completion are the same statements.
plain=$dir/../pgbench/first.sql
part=$work/first-part.sql
awk '
	/^-- claim(New)?SQL/ { print "-- claim() of bench/partition/claim.sql"
		# All 15 columns, as the server reads them; renamed where \\gset
		# would overwrite a -D variable (status).
		print "SELECT outcome, lock_token, operation_id, request_method AS c4, request_path AS c5,"
		print "    request_hash AS c6, fingerprint_version AS c7, status AS c8, response_status AS c9,"
		print "    response_content_type AS c10, response_headers AS c11, response_body AS c12,"
		print "    created_at AS c13, locked_at AS c14, lost"
		print "FROM part.claim(:client, :key, :method, :path, :fp, :fpver, :lockus, :retus)"
		skip = 1; next }
	skip && /^\\gset/ { skip = 0; print; next }
	skip { next }
	{ sub(/UPDATE idempotency_keys SET/, "UPDATE part.idempotency_keys SET"); print }
' "$plain" >"$part"
grep -q 'part.claim' "$part" && grep -q 'UPDATE part.idempotency_keys' "$part"

# bench SCRIPT LOGPREFIX SECONDS: pgbench at concurrency 8, per-transaction
# log under LOGPREFIX; prints "tps=...".
bench() {
	(cd "$work" && "$pgbench" "$url" -n -M prepared -c $conc -j 2 -T "$3" -f "$1" \
		--log --log-prefix="$2" "${dvars[@]}" >"$2.out" 2>&1) || { cat "$work/$2.out" >&2; return 1; }
	grep -o 'tps = [0-9.]*' "$work/$2.out" | head -1 | sed 's/tps = /tps=/'
}
stats() { python3 "$dir/stats.py" "$@"; }

reset_tables() {
	psqlq -c 'TRUNCATE idempotency_keys, payments, charges'
	psqlq -v schema=part -f "$dir/schema.sql" -f "$dir/claim.sql"
	# Daily partitions from the day before yesterday (where keys created
	# 48 h ago fall) to tomorrow: the steady state of a 24 h retention.
	psqlq -c "SELECT part.make_partitions('1 day', now() - interval '2 days', now() + interval '1 day')" >/dev/null
	psqlq -f "$dir/purge.sql"
}

# load TABLE: 1,000,000 keys created 48 h ago, as cmd/loadtest's retention
# scenario inserts them.
load() {
	local t0=$(now)
	psqlq -c "
		INSERT INTO $1 (client_id, idempotency_key, request_method, request_path,
			request_hash, fingerprint_version, status, operation_id, lock_token,
			response_status, response_content_type, response_body, created_at, locked_at)
		SELECT 'loadtest_expired', 'expired-' || g, 'POST', '/v1/payments',
			sha256(g::text::bytea), 1, 'completed', gen_random_uuid(), nextval('idempotency_lock_tokens'),
			201, 'application/json', convert_to('{\"id\":\"pay_expired_' || g || '\"}', 'UTF8'),
			now() - interval '48 hours' - g * interval '1 millisecond', now() - interval '48 hours'
		FROM generate_series(1, 1000000) g"
	psqlq -c "VACUUM ANALYZE $1" -c CHECKPOINT
	echo "loaded 1000000 expired keys into $1 in $(echo "$(now) - $t0" | bc) s"
}

check() {
	reset_tables
	echo "== functional checks of part.claim() (check.sql)"
	psql "$url" -X -v ON_ERROR_STOP=1 -f "$dir/check.sql"
	echo
	echo "== two first claims of one key across a partition boundary"
	# Partitions of 1 s: A claims k in one, holds its transaction 2 s; B
	# claims k 1.2 s later, so its now() and row fall in a later partition.
	psqlq -v schema=pstress -f "$dir/schema.sql" -f "$dir/claim.sql"
	psqlq -c "SELECT pstress.make_partitions('1 second', now() - interval '10 seconds', now() + interval '60 seconds')" >/dev/null
	for lock in false true; do
		psqlq -c "DELETE FROM pstress.idempotency_keys"
		psqlq -c "BEGIN" -c "SELECT outcome FROM pstress.claim('x', 'k', 'POST', '/p', '\x01', 1, 0, 3600000000, $lock)" \
			-c "SELECT pg_sleep(2)" -c "COMMIT" >"$work/a.out" &
		sleep 1.2
		b=$(psqlq -c "SELECT outcome FROM pstress.claim('x', 'k', 'POST', '/p', '\x01', 1, 0, 3600000000, $lock)")
		wait
		echo "use_lock=$lock: A outcome $(head -1 "$work/a.out"), B outcome $b;" \
			"rows of the key: $(psqlq -c "SELECT count(*) || ' in ' || count(DISTINCT tableoid) || ' partition(s)' FROM pstress.idempotency_keys WHERE idempotency_key = 'k'")"
	done
	psqlq -c "DROP SCHEMA pstress CASCADE"
}

hot() {
	reset_tables
	echo "== hot path: one first execution, concurrency $conc, 15 s runs, alternated"
	echo "plain = bench/pgbench/first.sql; part = the same with part.claim() (4 daily partitions)"
	for i in $(seq 1 $((reps + 1))); do
		for v in plain part; do
			local s=$plain; [[ $v == part ]] && s=$part
			echo "$v run $i: $(bench "$s" "hot-$v-$i" 15) $(stats "$work/hot-$v-$i".[0-9]*)"
		done
	done
}

# delete_run DUTY: plain table, the server's batched purge.
delete_run() {
	reset_tables
	load idempotency_keys
	rm -f "$work"/before.*
	echo "before: $(bench "$plain" before 15) $(stats "$work"/before.[0-9]*)"
	rm -f "$work"/during* "$work/purge.end"
	local t0=$(now)
	(psqlq -c "CALL purge_loop(500, $1)" >"$work/purge.out"; now >"$work/purge.end") &
	local i=0
	while [[ ! -f $work/purge.end ]]; do bench "$plain" "during$i" 5 >/dev/null; i=$((i + 1)); done
	wait
	local t1=$(cat "$work/purge.end") secs
	secs=$(echo "$t1 - $t0" | bc)
	echo "purge (rows|batches): $(cat "$work/purge.out") in $secs s = $(echo "1000000 / $secs" | bc) rows/s"
	echo "during: $(stats --from "$t0" --to "$t1" "$work"/during*.[0-9]*)"
	local tv=$(now)
	psqlq -c "VACUUM idempotency_keys"
	echo "afterwards (autovacuum is off here): VACUUM idempotency_keys took $(echo "$(now) - $tv" | bc) s"
}

# part_run drop|detach: partitioned table, the expired partition dropped
# 5 s into a 20 s run.
part_run() {
	reset_tables
	load part.idempotency_keys
	rm -f "$work"/before.*
	local parts
	parts=$(psqlq -c "SELECT string_agg(p::text, ' ') FROM part.expired_partitions('24 hours') p")
	echo "expired partitions: $parts ($(psqlq -c "SELECT count(*) FROM part.idempotency_keys WHERE created_at < now() - interval '24 hours'") rows)"
	echo "before: $(bench "$part" before 15) $(stats "$work"/before.[0-9]*)"
	rm -f "$work"/during*
	bench "$part" during 20 >"$work/during.tps" &
	sleep 5
	psqlq -c "SELECT 'lock sampler (samples|max waiting|samples with waiters): ' || concat_ws('|', samples, max_waiting, samples_with_waiters) FROM lock_sampler(3)" >"$work/sampler.out" &
	sleep 0.5
	local t0=$(now) cmds=() p
	for p in $parts; do
		if [[ $1 == detach ]]; then cmds+=(-c "ALTER TABLE part.idempotency_keys DETACH PARTITION $p CONCURRENTLY"); fi
		cmds+=(-c "DROP TABLE $p")
	done
	psql "$url" -X -v ON_ERROR_STOP=1 -c '\timing on' "${cmds[@]}" | grep -E 'Time|ERROR' | tr '\n' ' '
	local t1=$(now) secs
	wait
	secs=$(echo "$t1 - $t0" | bc)
	echo
	echo "purge: 1000000 rows in $secs s (psql connect included) = $(echo "1000000 / $secs" | bc) rows/s"
	cat "$work/sampler.out"
	echo "during the purge: $(stats --from "$t0" --to "$t1" "$work"/during.[0-9]*)"
	echo "whole 20 s run around it: $(cat "$work/during.tps") $(stats "$work"/during.[0-9]*)"
	echo "1 s around it: $(stats --from "$(echo "$t0 - 0.5" | bc)" --to "$(echo "$t1 + 0.5" | bc)" "$work"/during.[0-9]*)"
}

retention() {
	echo "== retention at scale: 1,000,000 keys created 48 h ago, first executions at concurrency $conc"
	for i in $(seq 1 "$reps"); do
		echo "--- run $i: batched DELETE, batch 500, duty cycle 0.25"; delete_run 0.25
		echo "--- run $i: DROP TABLE of the expired partition"; part_run drop
		echo "--- run $i: batched DELETE, batch 500, flat out"; delete_run 1
		echo "--- run $i: DETACH PARTITION ... CONCURRENTLY, then DROP TABLE"; part_run detach
	done
}

mkdir -p "$res"
for step in check hot retention; do
	if [[ $what == all || $what == "$step" ]]; then
		{ echo "# bench/partition/run.sh $step, $(date -u +%FT%TZ), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
			$step; } 2>&1 | tee "$res/partition-$step.txt"
	fi
done
