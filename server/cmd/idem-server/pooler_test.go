package main

import (
	"cmp"
	"context"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/pgbouncer"
	"github.com/idemkit/idem/internal/pgtest"
)

// TestRunBehindTransactionPooler: replicas that start together behind
// PgBouncer in transaction mode (keeping no prepared statement for its
// clients, as 1.18 does) with pgx's default query mode, or describe_exec,
// each refuse to start, saying in one line what to set in the database
// URL, rather than fail on the driver's error (some of them) or start and
// fail later (the others); in exec mode, a replica starts and serves
// payments and their replays.
func TestRunBehindTransactionPooler(t *testing.T) {
	dsn := pgtest.Bouncer(t, pgbouncer.Config{PoolMode: pgbouncer.Transaction, MaxPreparedStatements: pgbouncer.NoPreparedStatements()})
	for _, mode := range []string{"", "cache_statement", "describe_exec"} {
		url := dsn
		if mode != "" {
			url += " default_query_exec_mode=" + mode
		}
		errs := make([]error, 3)
		var wg sync.WaitGroup
		for i := range errs {
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				errs[i] = run(ctx, []string{"-addr", "127.0.0.1:0"}, func(k string) string {
					return map[string]string{"DATABASE_URL": url}[k]
				}, &syncBuffer{})
			})
		}
		wg.Wait()
		want := []string{"pgx's query mode " + cmp.Or(mode, "cache_statement") + " cannot work", "set default_query_exec_mode=exec"}
		for i, err := range errs {
			if err == nil || !strings.Contains(err.Error(), want[0]) || !strings.Contains(err.Error(), want[1]) || strings.Contains(err.Error(), "\n") {
				t.Errorf("mode %q, replica %d: run = %v; want one line saying %q and %q", mode, i, err, want[0], want[1])
			} else if i == 0 {
				t.Logf("mode %q: %v", mode, err)
			}
		}
	}

	url, _, stop := start(t, nil, map[string]string{"DATABASE_URL": dsn + " default_query_exec_mode=exec"})
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	const body = `{"amount": 4200, "currency": "usd", "customer": "cus_123"}`
	resp, b := post(t, client, url, "sk_test_demo", "k-pooler", body)
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("POST in exec mode: %d %s", resp.StatusCode, b)
	}
	resp, b2 := post(t, client, url, "sk_test_demo", "k-pooler", body)
	if resp.Header.Get("Idempotent-Replayed") != "true" || b2 != b {
		t.Errorf("retry in exec mode: %d %s, want the replay", resp.StatusCode, b2)
	}
	if err := stop(); err != nil {
		t.Fatalf("run in exec mode: %v", err)
	}
}
