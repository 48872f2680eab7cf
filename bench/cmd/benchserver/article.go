package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"io"
	"net/http"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// articleSchema is Step 1 of the seed article, as it prints it: the key
// table a service writes by hand.
const articleSchema = `
CREATE TABLE IF NOT EXISTS idempotency_keys_article (
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
CREATE INDEX IF NOT EXISTS idempotency_keys_article_created_idx ON idempotency_keys_article (created_at);`

// article is the seed article's Steps 2 and 3 written by hand, the way a
// reader would write them on pgx: the claim committed on its own, the
// read of the row on a conflict, and the business write with the
// completion in one transaction. It is what idem is measured against; it
// has none of idem's edges (no lease, takeover, release, fingerprint
// canonicalisation, first-sent policy or stored headers), so it is the
// cheapest correct-looking code a user would write instead.
type article struct {
	pool *pgxpool.Pool
	h    *handler
}

func (a *article) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	client, ok := authenticate(r)
	key := r.Header.Get("Idempotency-Key")
	switch {
	case !ok:
		http.Error(w, "unauthorized", http.StatusUnauthorized)
		return
	case key == "":
		http.Error(w, "Idempotency-Key required", http.StatusBadRequest)
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 1<<20))
	if err != nil {
		http.Error(w, "body", http.StatusBadRequest)
		return
	}
	h := sha256.New()
	io.WriteString(h, r.Method+" "+r.URL.Path+"\n")
	h.Write(body)
	hash := h.Sum(nil)

	// Step 2: claim the key before doing the work.
	var one int
	err = a.pool.QueryRow(ctx, `
		INSERT INTO idempotency_keys_article
		    (client_id, idempotency_key, request_method, request_path, request_hash, status, locked_at)
		VALUES ($1, $2, $3, $4, $5, 'started', now())
		ON CONFLICT (client_id, idempotency_key) DO NOTHING
		RETURNING 1`, client, key, r.Method, r.URL.Path, hash).Scan(&one)
	if errors.Is(err, pgx.ErrNoRows) {
		a.existing(ctx, w, client, key, hash)
		return
	}
	if err != nil {
		http.Error(w, "database", http.StatusInternalServerError)
		return
	}
	in, err := parseRequest(body)
	if err != nil {
		a.release(ctx, client, key)
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	// The downstream call, keyed by the key (payments only), then Step 3:
	// execute and record the result atomically.
	if err := a.h.call(ctx, key, &in); err != nil {
		a.release(ctx, client, key)
		http.Error(w, "processor", http.StatusBadGateway)
		return
	}
	var resp []byte
	err = pgx.BeginFunc(ctx, a.pool, func(tx pgx.Tx) error {
		var err error
		if resp, err = a.h.write(ctx, tx, client, in); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `
			UPDATE idempotency_keys_article
			SET status = 'completed', response_status = 201, response_body = $3
			WHERE client_id = $1 AND idempotency_key = $2`, client, key, resp)
		return err
	})
	if err != nil {
		a.release(ctx, client, key)
		http.Error(w, "database", http.StatusInternalServerError)
		return
	}
	writeJSON(w, http.StatusCreated, resp, false)
}

// existing applies the article's rules to a key that has a row.
func (a *article) existing(ctx context.Context, w http.ResponseWriter, client, key string, hash []byte) {
	var (
		stored []byte
		status string
		code   *int
		resp   []byte
	)
	err := a.pool.QueryRow(ctx, `
		SELECT request_hash, status, response_status, response_body
		FROM idempotency_keys_article
		WHERE client_id = $1 AND idempotency_key = $2`, client, key).Scan(&stored, &status, &code, &resp)
	switch {
	case errors.Is(err, pgx.ErrNoRows): // released meanwhile
		w.Header().Set("Retry-After", "1")
		http.Error(w, "in progress", http.StatusConflict)
	case err != nil:
		http.Error(w, "database", http.StatusInternalServerError)
	case !bytes.Equal(stored, hash):
		http.Error(w, "key reused with another request", http.StatusUnprocessableEntity)
	case status == "completed" && code != nil:
		writeJSON(w, *code, resp, true)
	default:
		w.Header().Set("Retry-After", "1")
		http.Error(w, "in progress", http.StatusConflict)
	}
}

// release deletes a started key whose request failed, so that a retry can
// claim it again (the article leaves this to the reader).
func (a *article) release(ctx context.Context, client, key string) {
	_, _ = a.pool.Exec(context.WithoutCancel(ctx), `
		DELETE FROM idempotency_keys_article
		WHERE client_id = $1 AND idempotency_key = $2 AND status = 'started'`, client, key)
}
