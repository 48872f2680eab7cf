#!/usr/bin/env bash
# Runs the RoundTrip benchmarks in ROUNDS interleaved rounds (each round runs
# every peer once, so that the noise of a shared machine falls on all of
# them alike), then compares the peers with benchstat, bare as the base.
#
#   bench/roundtrip.sh [ROUNDS] [OUTDIR]     (defaults: 10, bench/results)
#
# CPUS sets the GOMAXPROCS values the benchmarks run with (go test -cpu),
# "2" by default. With CPUS=1 the client and the httptest server share one
# P: slower, but far less scheduler noise on a 2-core machine, which is what
# resolves a few percent over loopback.
#
# OUTDIR gets roundtrip.txt (the raw output) and one file per peer with the
# peer's name taken out of the benchmark names, for benchstat.
set -euo pipefail
cd "$(dirname "$0")"
rounds=${1:-10}
out=${2:-results}
mkdir -p "$out"
bin=$(mktemp -d)/bench.test
trap 'rm -rf "$(dirname "$bin")"' EXIT
go test -c -o "$bin" .
: > "$out/roundtrip.txt"
for i in $(seq "$rounds"); do
	echo "round $i of $rounds" >&2
	"$bin" -test.run '^$' -test.bench 'RoundTrip' -test.benchmem -test.cpu "${CPUS:-2}" >> "$out/roundtrip.txt"
done
peers=(bare idem retryablehttp failsafe)
args=()
for p in "${peers[@]}"; do
	{
		grep -E '^(goos|goarch|pkg|cpu):' "$out/roundtrip.txt" | awk '!seen[$0]++'
		grep -E "^BenchmarkRoundTrip[A-Za-z]*/$p(-[0-9]+)?[[:space:]]" "$out/roundtrip.txt" | sed -E "s#/$p([-[:space:]])#\\1#"
	} > "$out/$p.txt"
	args+=("$p=$out/$p.txt")
done
go tool benchstat "${args[@]}" | tee "$out/benchstat.txt"

# Paired by round: each round runs every peer once, back to back, so the
# ratio of a peer's sec/op to bare's in the same round cancels what slows a
# whole round down (another process, the VM's neighbours), which benchstat's
# unpaired test cannot. Prints the median ratio and its quartiles over the
# rounds.
{
	echo "sec/op against bare in the same round (median [q1, q3] over $rounds rounds)"
	for b in RoundTrip RoundTripFaults RoundTripStub; do
		for p in "${peers[@]:1}"; do
			paste <(grep -E "^Benchmark$b/bare(-[0-9]+)?[[:space:]]" "$out/roundtrip.txt" | awk '{print $3}') \
				<(grep -E "^Benchmark$b/$p(-[0-9]+)?[[:space:]]" "$out/roundtrip.txt" | awk '{print $3}') |
				awk '{ print $2 / $1 }' | sort -g | awk -v b="$b" -v p="$p" '
					{ r[NR] = $1 }
					END { printf "%-16s %-14s %6.3f [%5.3f, %5.3f]\n", b, p, r[int((NR + 1) / 2)], r[int(NR / 4) + 1], r[int(3 * NR / 4) + 1] }'
		done
	done
} | tee "$out/paired.txt"
