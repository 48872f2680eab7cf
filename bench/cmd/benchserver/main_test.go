package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
)

// TestThreeWays runs each handler the three ways against PostgreSQL: a
// keyed first execution writes one row and answers 201; its retry gets the
// same body replayed and writes nothing; the key with another body gets
// 422; an unkeyed request writes a row each time; a request without the
// client's token writes nothing.
func TestThreeWays(t *testing.T) {
	for _, tc := range []struct {
		handler string
		oneTx   bool
	}{{"orders", false}, {"orders", true}, {"payments", false}} {
		name := tc.handler
		if tc.oneTx {
			name += "/one-transaction"
		}
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			pool := pgtest.Pool(t)
			require.NoError(t, migrate(ctx, pool, true, false))
			h := &handler{name: tc.handler}
			if tc.handler == "payments" {
				p, err := startProcessor()
				require.NoError(t, err)
				t.Cleanup(p.Close)
				h.processor, h.client = p.URL, &http.Client{}
			}
			srv := httptest.NewServer(routes(pool, h, tc.oneTx, slog.New(slog.DiscardHandler)))
			t.Cleanup(srv.Close)
			table := "bench_" + tc.handler
			rows := func() (n int) {
				require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&n))
				return n
			}
			post := func(way, key, body, token string) (int, string, bool) {
				req, err := http.NewRequest(http.MethodPost, srv.URL+"/"+way+"/v1/"+tc.handler, strings.NewReader(body))
				require.NoError(t, err)
				req.Header.Set("Authorization", "Bearer "+token)
				req.Header.Set("Content-Type", "application/json")
				if key != "" {
					req.Header.Set("Idempotency-Key", key)
				}
				resp, err := http.DefaultClient.Do(req)
				require.NoError(t, err)
				defer resp.Body.Close()
				b, err := io.ReadAll(resp.Body)
				require.NoError(t, err)
				return resp.StatusCode, string(b), resp.Header.Get("Idempotent-Replayed") == "true"
			}
			const body = `{"amount":100,"currency":"usd","customer":"cus_1"}`
			want := 0
			for _, way := range []string{"idem", "article"} {
				key := uuid.NewString()
				status, first, _ := post(way, key, body, "sk_test_demo")
				require.Equal(t, http.StatusCreated, status, "%s: %s", way, first)
				want++
				assert.Equal(t, want, rows(), "%s: one row for the first execution", way)
				if tc.handler == "payments" {
					assert.Contains(t, first, `"charge":"ch_`, way)
				}
				status, again, replayed := post(way, key, body, "sk_test_demo")
				assert.Equal(t, http.StatusCreated, status, way)
				assert.True(t, replayed, "%s: the retry is a replay", way)
				assert.JSONEq(t, first, again, way)
				status, _, _ = post(way, key, strings.Replace(body, "100", "200", 1), "sk_test_demo")
				assert.Equal(t, http.StatusUnprocessableEntity, status, way)
				status, _, _ = post(way, uuid.NewString(), body, "wrong")
				assert.Equal(t, http.StatusUnauthorized, status, way)
				assert.Equal(t, want, rows(), "%s: nothing written by the retry, the reuse and the stranger", way)
			}
			for range 2 {
				status, b, _ := post("unkeyed", "", body, "sk_test_demo")
				require.Equal(t, http.StatusCreated, status, b)
				want++
			}
			assert.Equal(t, want, rows(), "unkeyed: a row per request")
			// read: the row a first execution answered, by its id.
			_, created, _ := post("unkeyed", "", body, "sk_test_demo")
			var row struct{ ID int64 }
			require.NoError(t, json.Unmarshal([]byte(created), &row))
			for _, tt := range []struct {
				id, token string
				status    int
			}{{fmt.Sprint(row.ID), "sk_test_demo", http.StatusOK}, {fmt.Sprint(row.ID), "wrong", http.StatusUnauthorized}, {"0", "sk_test_demo", http.StatusNotFound}} {
				req, _ := http.NewRequest(http.MethodGet, srv.URL+"/read/v1/"+tc.handler+"/"+tt.id, nil)
				req.Header.Set("Authorization", "Bearer "+tt.token)
				resp, err := http.DefaultClient.Do(req)
				require.NoError(t, err)
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				assert.Equal(t, tt.status, resp.StatusCode, "read %s: %s", tt.id, b)
				if tt.status == http.StatusOK {
					assert.JSONEq(t, created, string(b), "read: the row as its POST answered it")
				}
			}
			status, _, _ := post("article", "", body, "sk_test_demo")
			assert.Equal(t, http.StatusBadRequest, status, "article: a key is required")
		})
	}
}

// TestMigrateOpenIndex: the key table has the open keys' index with
// -open-index and none without, also when a run before left one.
func TestMigrateOpenIndex(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t)
	hasIndex := func() (ok bool) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT to_regclass('idempotency_keys_open_idx') IS NOT NULL`).Scan(&ok))
		return ok
	}
	require.NoError(t, migrate(ctx, pool, false, false))
	assert.False(t, hasIndex(), "without -open-index")
	require.NoError(t, migrate(ctx, pool, false, true))
	assert.True(t, hasIndex(), "with -open-index")
	require.NoError(t, migrate(ctx, pool, true, false))
	assert.False(t, hasIndex(), "without -open-index, after a run with it")
}

func TestParseFlags(t *testing.T) {
	c, err := parseFlags([]string{"-database-url", "postgres://x", "-handler", "payments", "-one-transaction"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, "payments", c.handler)
	assert.True(t, c.oneTx)
	for _, args := range [][]string{
		{},
		{"-database-url", "x", "-handler", "nope"},
		{"-database-url", "x", "-addr", "10.0.0.1:80"},
		{"-database-url", "x", "-db-max-conns", "0"},
		{"-database-url", "x", "extra"},
	} {
		_, err := parseFlags(args, io.Discard)
		assert.Error(t, err, "%q", args)
	}
}

// TestDriveServesEachWay runs each way of -drive (drive.go) with a few
// requests, as backend-instructions.sh runs it under callgrind: the ways
// that create write one row a request, a replay and a read write none
// beyond the 20 rows they create first, and an unknown way is an error.
func TestDriveServesEachWay(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t)
	for _, tc := range []struct {
		way  string
		rows int
	}{{"first", 3}, {"article", 3}, {"unkeyed", 3}, {"replay", 20}, {"read", 20}} {
		t.Run(tc.way, func(t *testing.T) {
			require.NoError(t, migrate(ctx, pool, true, false))
			h := &handler{name: "payments"}
			require.NoError(t, drive(routes(pool, h, false, slog.New(slog.DiscardHandler)), h, tc.way, 3))
			var n int
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM bench_payments`).Scan(&n))
			assert.Equal(t, tc.rows, n)
		})
	}
	h := &handler{name: "payments"}
	assert.Error(t, drive(routes(pool, h, false, slog.New(slog.DiscardHandler)), h, "second", 1))
}
