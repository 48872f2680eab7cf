#!/usr/bin/env bash
# Runs the load test once per configuration, in ROUNDS interleaved rounds
# (each round runs every configuration once, back to back, starting one
# configuration further on than the round before), so that the
# drift of a shared machine falls on every configuration alike, then
# prints each configuration's medians over the rounds.
#
#   bench/configs.sh CONFIG...
#
# A CONFIG is "SETTINGS;SERVER_ARGS". SETTINGS is a comma-separated list of
# PostgreSQL settings applied to the bench database alone, for the
# sessions that start after it (ALTER DATABASE … SET; no restart, nothing
# else on the cluster is touched), e.g. "commit_delay=200,commit_siblings=5".
# SERVER_ARGS go to idem-server through the load test's -server-args, e.g.
# ";-async-claims". An empty CONFIG ("") is the defaults. Every setting
# named in any CONFIG is reset (ALTER DATABASE … RESET) before each run of
# a configuration that does not name it, and all are reset at the end.
#
# Before each run it VACUUMs the database (VACUUM=0: not), untimed: the
# key table's completions are updates that leave dead rows behind, which
# autovacuum would clean up on a production database, and this machine's
# cluster runs with autovacuum off. Without it the keyed scenarios slow
# down run after run while the unkeyed one (inserts only) does not.
#
# The environment sets the rest: DATABASE_URL (default
# postgres://postgres@127.0.0.1:5432/idem_bench, a database of the load
# test's own), CONCURRENCY (16), ROUNDS (4), DURATION (5s), SCENARIOS
# (first,replay,unkeyed), OUT (bench/results/configs.jsonl: one JSON
# object per scenario and run, with "config" and "round" added).
#
# For each configuration it prints the median req/s of each scenario, the
# median of the per-round ratios first/unkeyed and replay/first (each
# round's ratio compares runs a few seconds apart), the round trips per
# request (the server's own count, "db rt" in the load test), the CPU
# time per request of the server and of the database's backends ("srv ms",
# "db ms") and the machine's busy share.
set -euo pipefail
cd "$(dirname "$0")"
url=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/idem_bench}
conc=${CONCURRENCY:-16}
rounds=${ROUNDS:-4}
dur=${DURATION:-5s}
scen=${SCENARIOS:-first,replay,unkeyed}
out=${OUT:-results/configs.jsonl}
[[ $# -gt 0 ]] || set -- ""
psql=(psql "$url" -X -q -At -v ON_ERROR_STOP=1)
db=$("${psql[@]}" -c 'SELECT current_database()')

# The settings any configuration names, to reset where one does not.
declare -A named=()
for cfg in "$@"; do
	IFS=, read -ra kv <<< "${cfg%%;*}"
	for s in "${kv[@]}"; do [[ -n $s ]] && named[${s%%=*}]=1; done
done
reset_all() {
	local name
	for name in "${!named[@]}"; do "${psql[@]}" -c "ALTER DATABASE \"$db\" RESET $name"; done
}
trap reset_all EXIT

bin=$(mktemp -d)/loadtest
trap 'reset_all; rm -rf "$(dirname "$bin")"' EXIT
go build -o "$bin" ./cmd/loadtest
mkdir -p "$(dirname "$out")"
: > "$out"
echo "load average at the start: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
configs=("$@")
n=${#configs[@]}
for r in $(seq "$rounds"); do
	# Each round starts one configuration further on, so that none is
	# always the first after the previous round's last.
	for i in $(seq 0 $((n - 1))); do
		cfg=${configs[$(((r - 1 + i) % n))]}
		settings=${cfg%%;*}
		args=""
		[[ $cfg == *";"* ]] && args=${cfg#*;}
		reset_all
		IFS=, read -ra kv <<< "$settings"
		for s in "${kv[@]}"; do
			[[ -n $s ]] && "${psql[@]}" -c "ALTER DATABASE \"$db\" SET ${s%%=*} = '${s#*=}'"
		done
		if [[ ${VACUUM:-1} == 1 ]]; then
			"${psql[@]}" -c 'VACUUM'
		fi
		echo "round $r of $rounds: [${cfg}] (load average $(cut -d' ' -f1 /proc/loadavg))" >&2
		"$bin" -database-url "$url" -concurrency "$conc" -duration "$dur" -scenario "$scen" \
			-server-args "$args" -json 2> >(grep -v '^loadtest: \(building\|server\)' >&2) |
			jq -c --arg c "$cfg" --argjson r "$r" '. + {config: $c, round: $r}' >> "$out"
	done
done
jq -rs --argjson conc "$conc" '
	def median: sort | if length == 0 then null elif length % 2 == 1 then .[length / 2 | floor]
		else (.[length / 2 - 1] + .[length / 2]) / 2 end;
	def f2: if . == null then "-" else (. * 100 | round / 100 | tostring) end;
	def rate($s): map(select(.scenario == $s) | .req_per_s);
	group_by(.config)[] as $runs
	| ($runs | group_by(.round) | map(
		(map(select(.scenario == "first"))[0].req_per_s) as $a
		| (map(select(.scenario == "unkeyed"))[0].req_per_s) as $c
		| (map(select(.scenario == "replay"))[0].req_per_s) as $b
		| {ac: (if $a and $c then $a / $c else null end), ba: (if $a and $b then $b / $a else null end)})) as $ratios
	| "[\($runs[0].config)] c\($conc), \($runs | map(.round) | unique | length) rounds: "
	+ "first \($runs | rate("first") | median | f2) req/s, unkeyed \($runs | rate("unkeyed") | median | f2), replay \($runs | rate("replay") | median | f2); "
	+ "first/unkeyed \($ratios | map(.ac | select(. != null)) | median | f2) [\($ratios | map(.ac | f2) | join(" "))], "
	+ "replay/first \($ratios | map(.ba | select(. != null)) | median | f2); "
	+ "db rt first \($runs | map(select(.scenario == "first") | .db_round_trips_per_req) | median | f2), "
	+ "unkeyed \($runs | map(select(.scenario == "unkeyed") | .db_round_trips_per_req) | median | f2), "
	+ "replay \($runs | map(select(.scenario == "replay") | .db_round_trips_per_req) | median | f2); "
	+ "srv ms first \($runs | map(select(.scenario == "first") | .server_cpu_ms_per_req) | median | f2), "
	+ "unkeyed \($runs | map(select(.scenario == "unkeyed") | .server_cpu_ms_per_req) | median | f2); "
	+ "db ms first \($runs | map(select(.scenario == "first") | .db_cpu_ms_per_req) | median | f2), "
	+ "unkeyed \($runs | map(select(.scenario == "unkeyed") | .db_cpu_ms_per_req) | median | f2); "
	+ "busy \($runs | map(.machine_cpu_busy) | median | f2)"
' "$out"
