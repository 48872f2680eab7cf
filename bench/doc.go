// Package bench compares idem with what a user would pick instead, and
// load-tests the reference server. It is its own module, so that the peer
// libraries it measures against (hashicorp/go-retryablehttp,
// failsafe-go/failsafe-go) never enter the dependency graph of
// github.com/idemkit/idem.
//
// Client transport, in this directory:
//
//	go test -run '^$' -bench 'RoundTrip' -benchmem
//	./roundtrip.sh 20 results   # interleaved rounds, then benchstat with bare as the base
//	./instructions.sh 4000 5    # instructions per op under callgrind (valgrind), two op counts differenced
//
// Reference server, with the real idem-server binary over loopback:
//
//	go run ./cmd/loadtest -database-url postgres://postgres@127.0.0.1/test -duration 10s -concurrency 8
//
// BENCHMARKS.md at the repository root has the figures of one run and
// the exact commands.
package bench
