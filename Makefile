# idem — make test runs every test (PostgreSQL ones included, see
# docs/testing.md: "How the tests find PostgreSQL") but the long ones through
# PgBouncer, which make poolers runs; make check is what must be green before a commit.
GO          ?= go
STATICCHECK ?= $(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2
PKGS        := ./...

.PHONY: test test-root test-chaos quick poolers failover check fmt vet staticcheck bench scenarios fuzz

# bench/, otel/, examples/router, examples/outbox,
# server/sqlstore/internal/pqtest and server/sqlstore/internal/gormtest are
# modules of their own (the peer libraries, OpenTelemetry, failsafe-go,
# River, lib/pq and GORM stay out of ours); their tests run too, beside the
# module's and the chaos test (verbose, so that its timeline shows while it
# runs), four jobs at a time: most of these tests wait on PostgreSQL or on
# replicas more than they compute, so one after the other left the cores
# idle for half of the run. The failover test is not part of it: make
# failover runs it (CI runs both).
MODULES := bench otel examples/router examples/outbox \
	server/sqlstore/internal/pqtest server/sqlstore/internal/gormtest

test:
	@$(MAKE) --no-print-directory -j$(TEST_JOBS) test-root test-chaos $(addprefix test-module/,$(MODULES))

TEST_JOBS ?= 4

test-root:
	$(GO) test -race -count=1 $$($(GO) list $(PKGS) | grep -v '/examples/chaos$$')

test-module/%:
	cd $* && $(GO) test -race -count=1 ./...

test-chaos:
	$(GO) test -race -count=1 -v -skip '^TestFailover$$' ./examples/chaos

# failover: the failover test (docs/chaos.md, "The failover test"): a
# PostgreSQL primary and a streaming standby of its own, the primary
# killed under load and the standby promoted, with synchronous and then
# asynchronous replication (20s of load each, about a minute in all). It
# needs the PostgreSQL binaries (initdb, pg_basebackup), not a running
# server; without them it is skipped, except under CI=true.
failover:
	$(GO) test -race -count=1 -v -run '^TestFailover$$' ./examples/chaos

# poolers: the tests through PgBouncer that make test leaves out (build tag
# poolers; they need pgbouncer, see docs/testing.md): the conformance
# suites of pgstore, sqlstore and sqlstore on lib/pq through PgBouncer in
# transaction mode, in each query mode that works there, then a short
# chaos run through it. About three minutes on a quiet 2-core machine.
poolers:
	$(GO) test -tags poolers -race -count=1 -run 'PgBouncer' ./server/pgstore ./server/sqlstore
	cd server/sqlstore/internal/pqtest && $(GO) test -tags poolers -race -count=1 -run 'PgBouncer' ./...
	$(GO) test -tags poolers -race -count=1 -v -run '^TestChaosThroughPgBouncer$$' ./examples/chaos

# quick: the tests without the chaos test and the long end-to-end runs
# (-short), for the edit-test loop; make test is what CI runs.
quick:
	$(GO) test -short -count=1 $(PKGS)

fmt:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

vet:
	$(GO) vet -tags poolers $(PKGS)
	cd bench && $(GO) vet ./...
	cd otel && $(GO) vet ./...
	cd examples/router && $(GO) vet ./...
	cd examples/outbox && $(GO) vet ./...
	cd server/sqlstore/internal/pqtest && $(GO) vet -tags poolers ./...
	cd server/sqlstore/internal/gormtest && $(GO) vet ./...

staticcheck:
	$(STATICCHECK) -tags poolers $(PKGS)
	cd bench && $(STATICCHECK) ./...
	cd otel && $(STATICCHECK) ./...
	cd examples/router && $(STATICCHECK) ./...
	cd examples/outbox && $(STATICCHECK) ./...
	cd server/sqlstore/internal/pqtest && $(STATICCHECK) -tags poolers ./...
	cd server/sqlstore/internal/gormtest && $(STATICCHECK) ./...

check: fmt vet staticcheck test poolers

bench:
	$(GO) test -run '^$$' -bench . -benchmem $(PKGS)

fuzz:
	$(GO) test -run '^$$' -fuzz '^FuzzParse$$' -fuzztime 30s ./internal/keyheader
	$(GO) test -run '^$$' -fuzz '^FuzzParseRetryAfter$$' -fuzztime 30s .
	$(GO) test -run '^$$' -fuzz '^FuzzInsertKeyField$$' -fuzztime 30s .
	$(GO) test -run '^$$' -fuzz '^FuzzPeekBody$$' -fuzztime 30s .
	$(GO) test -run '^$$' -fuzz '^FuzzFingerprint$$' -fuzztime 30s ./server/idempotency
	$(GO) test -run '^$$' -fuzz '^FuzzCanonicalDifferential$$' -fuzztime 30s ./server/idempotency
	$(GO) test -run '^$$' -fuzz '^FuzzSealOpen$$' -fuzztime 30s ./server/idempotency

scenarios:
	$(GO) run ./examples/scenarios
