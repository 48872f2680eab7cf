#!/usr/bin/env bash
# Counts the instructions per operation of the peers over loopback with
# valgrind's callgrind, which, unlike time, does not move with the load of
# a shared machine.
#
#   bench/instructions.sh [OPS] [ROUNDS] [OUTDIR]   (defaults: 4000, 3, bench/results/instructions)
#
# Each peer runs TestOps (instructions_test.go: keyed 1 KiB POSTs to an
# httptest server in the same process, answered 201) twice under
# callgrind, with OPS/2 and OPS operations. The difference of the two
# instruction totals divided by OPS/2 is the cost of one operation, with
# the start-up, the warm-up and the test framework cancelled out. The
# server's share is in every peer's figure alike. ROUNDS repeats this,
# interleaving the peers, and the table gives the median round.
#
# The binary is built with CGO_ENABLED=0 and runs with GOMAXPROCS=1 (with
# more Ps, an idle one spins and polls for as long as an op takes in wall
# time, which callgrind counts: any extra work is counted many times
# over) and GODEBUG=asyncpreemptoff=1,cpu.rdtscp=off: callgrind asserts
# on Go's preemption signals, and valgrind 3.19 does not know RDTSCP,
# which the runtime executes when a thread sleeps on a contended runtime
# lock, so without cpu.rdtscp=off a run dies of SIGILL now and then.
# GOGC is passed through: GOGC=off leaves the GC's cycles, which fall
# whole into one window or the next, out of the count. PEERS (a list)
# runs only those peers. Each run at OPS=4000 takes a minute or two;
# callgrind is some 50 to 100 times slower than native.
#
# bare-firstsent is bare sending the bytes idem sends (the key and
# Repeatability-First-Sent), so that idem over it is idem's own cost on
# equal wire bytes; the table ends with that ratio.
#
# STUB=1 runs TestStubOps instead: the same requests sent to the
# in-memory base of BenchmarkRoundTripStub, each peer's own cost on the
# client with no server and no network in the count (use more OPS there:
# an op is some 40 times cheaper).
#
# STW=1 adds gcstoptheworld=1 to GODEBUG: each GC cycle marks with the
# world stopped, so its work is the same whatever the timing. With the
# concurrent GC, how many ops run while the mark phase is on (write
# barriers, allocating black, assists) depends on wall time under
# callgrind, which a peer that never blocks (the stub) feels most: its
# figure moved by 20% from run to run with GOGC=100, and by 1% with
# STW=1.
#
# WARMUP=N sends N ops before the counted ones in each run (default 10):
# a type assertion's cache (io.Copy's, shared by the whole binary) is
# filled on one miss in 1024, and more rarely as it grows, so its misses
# end at a random op and move a peer's stub figure by up to ~180
# instructions per op from run to run. A longer warm-up makes that less
# likely (5000 did not rule it out), at the price of its time.
#
# BASE=REV also runs the idem peers built on the root package at git
# revision REV (named idem@REV, ...), interleaved with the others, and
# prints each over its @REV twin: a before/after on the same binary of
# the bench module, so that the peers it shares are the same code.
#
# OUTDIR gets the callgrind.out files of the last round (for
# callgrind_annotate, e.g. on callgrind.idem.4000) and instructions.txt,
# the table.
set -euo pipefail
cd "$(dirname "$0")"
ops=${1:-4000}
rounds=${2:-3}
out=${3:-results/instructions}
half=$((ops / 2))
if ((half < 1)); then
	echo "OPS must be at least 2" >&2
	exit 2
fi
command -v valgrind > /dev/null || { echo "valgrind is not installed" >&2; exit 1; }
mkdir -p "$out"
bin=$(mktemp -d)/bench.test
trap 'rm -rf "$(dirname "$bin")"' EXIT
CGO_ENABLED=0 go test -c -o "$bin" .
read -r -a peers <<< "${PEERS:-bare bare-firstsent idem idem-nofirstsent retryablehttp failsafe}"
test=TestOps
if [[ -n "${STUB:-}" ]]; then test=TestStubOps; fi

# With BASE, a second binary: this bench module, built with the root
# package of revision BASE in place of the work tree's.
if [[ -n "${BASE:-}" ]]; then
	root=$(dirname "$bin")/root
	mkdir "$root"
	git -C .. archive "$BASE" | tar -x -C "$root"
	cp go.mod "$root/bench.mod"
	cp go.sum "$root/bench.sum"
	go mod edit -modfile "$root/bench.mod" -replace "github.com/idemkit/idem=$root"
	CGO_ENABLED=0 go test -c -modfile "$root/bench.mod" -o "$bin.base" .
	for p in "${peers[@]}"; do
		if [[ "$p" == idem* ]]; then peers+=("$p@$BASE"); fi
	done
fi

# total PEER N runs TestOps (or TestStubOps) with N ops under callgrind
# and prints the instruction total. PEER@REV runs PEER on BASE's binary.
total() {
	local f="$out/callgrind.$1.$2" b=$bin
	if [[ "$1" == *@* ]]; then b=$bin.base; fi
	GOMAXPROCS=1 GODEBUG=asyncpreemptoff=1,cpu.rdtscp=off${STW:+,gcstoptheworld=1} valgrind --tool=callgrind --callgrind-out-file="$f" \
		"$b" -test.run "^$test\$" -test.count 1 -warmup "${WARMUP:-10}" -ops "$2" -peer "${1%@*}" > "$f.log" 2>&1 ||
		{ cat "$f.log" >&2; exit 1; }
	awk '/^summary:/ { print $2 }' "$f"
}

declare -A per # per[peer] = the per-op figures of the rounds, one a line
for r in $(seq "$rounds"); do
	for p in "${peers[@]}"; do
		a=$(total "$p" "$half")
		b=$(total "$p" "$ops")
		v=$(((b - a) / (ops - half)))
		echo "round $r of $rounds: $p $v instructions/op" >&2
		per[$p]+="$v"$'\n'
	done
done

median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
{
	echo "instructions per op, median of $rounds rounds, $half and $ops ops after ${WARMUP:-10} (go test $test under callgrind, GOMAXPROCS=1, GOGC=${GOGC:-100}${STW:+, gcstoptheworld=1}${BASE:+, BASE=$BASE})"
	echo "x-bare: the ratio of the medians; paired: the median of the ratios to bare in the same round"
	base=$(printf '%s' "${per[bare]}" | median)
	printf '%-14s %14s %8s %8s   %s\n' client instructions/op x-bare paired rounds
	for p in "${peers[@]}"; do
		m=$(printf '%s' "${per[$p]}" | median)
		paired=$(paste <(printf '%s' "${per[$p]}") <(printf '%s' "${per[bare]}") | awk '{ printf "%.6f\n", $1 / $2 }' | median)
		printf '%-14s %14d %8.3f %8.3f   %s\n' "$p" "$m" "$(echo "$m / $base" | bc -l)" "$paired" "$(printf '%s' "${per[$p]}" | tr '\n' ' ')"
	done
	# Equal wire bytes: idem sends the key and Repeatability-First-Sent,
	# which bare-firstsent sends too (and idem-nofirstsent does not).
	if [[ -n "${per[idem]:-}" && -n "${per[bare-firstsent]:-}" ]]; then
		m=$(printf '%s' "${per[idem]}" | median)
		b=$(printf '%s' "${per[bare-firstsent]}" | median)
		paired=$(paste <(printf '%s' "${per[idem]}") <(printf '%s' "${per[bare-firstsent]}") | awk '{ printf "%.6f\n", $1 / $2 }' | median)
		printf 'idem over bare-firstsent (the same request bytes): %.3f, paired %.3f\n' "$(echo "$m / $b" | bc -l)" "$paired"
	fi
	for p in "${peers[@]}"; do
		[[ "$p" == *@* ]] || continue
		m=$(printf '%s' "${per[${p%@*}]}" | median)
		b=$(printf '%s' "${per[$p]}" | median)
		paired=$(paste <(printf '%s' "${per[${p%@*}]}") <(printf '%s' "${per[$p]}") | awk '{ printf "%.6f\n", $1 / $2 }' | median)
		printf '%s over %s: %.3f, paired %.3f\n' "${p%@*}" "$p" "$(echo "$m / $b" | bc -l)" "$paired"
	done
} | tee "$out/instructions.txt"
