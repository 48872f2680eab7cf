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
# keys' index: CreateOpenKeysIndex is opt-in), bench_orders, and the two
# key tables of the mixes order-twocommits-{checked,article}.sql.
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
);
-- The key table as it was with its five CHECK constraints (dropped since;
-- order-twocommits-checked.sql), and the seed article's by hand
-- (bench/cmd/benchserver/article.go; order-twocommits-article.sql).
CREATE TABLE idempotency_keys_checked (LIKE idempotency_keys INCLUDING ALL,
    CONSTRAINT idempotency_keys_checked_key_check CHECK (octet_length(idempotency_key) BETWEEN 1 AND 255),
    CONSTRAINT idempotency_keys_checked_status_check CHECK (status IN ('started', 'completed', 'released')),
    CONSTRAINT idempotency_keys_checked_response_check CHECK ((status = 'completed') = (response_status IS NOT NULL)),
    CONSTRAINT idempotency_keys_checked_response_status_check CHECK (response_status BETWEEN 100 AND 599),
    CONSTRAINT idempotency_keys_checked_lease_check CHECK (lease_us >= 0 AND retention_us >= 0));
CREATE TABLE idempotency_keys_article (
    client_id        text        NOT NULL,
    idempotency_key  text        NOT NULL,
    request_method   text        NOT NULL,
    request_path     text        NOT NULL,
    request_hash     bytea       NOT NULL,
    status           text        NOT NULL,
    response_status  integer,
    response_body    jsonb,
    created_at       timestamptz NOT NULL DEFAULT now(),
    locked_at        timestamptz,
    PRIMARY KEY (client_id, idempotency_key)
);
CREATE INDEX idempotency_keys_article_created_idx ON idempotency_keys_article (created_at)"
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
