package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"time"

	"github.com/google/uuid"
)

// drive serves n requests of one way through mux, in this process and
// without a listener, for bench/backend-instructions.sh, which counts the
// instructions of this process and of its one PostgreSQL backend:
// first (idem's route, a new key each, sent once: no first-sent time),
// article, unkeyed, replay (a retry of one of 20 keys created first,
// untimed, all with a first-sent time a minute old) or read (a GET of one of 20 rows created first through the
// unkeyed route). Payments call no processor here (h.processor is
// empty): its round trip is the same for every way.
func drive(mux http.Handler, h *handler, way string, n int) error {
	sent := time.Now().Add(-time.Minute).UTC().Format(http.TimeFormat)
	body := func(i int) []byte {
		return []byte(`{"amount":` + strconv.Itoa(100+i) + `,"currency":"usd","customer":"cus_` + strconv.Itoa(i) + `"}`)
	}
	do := func(method, route, key string, b []byte, want int) (*httptest.ResponseRecorder, error) {
		req := httptest.NewRequest(method, route, bytes.NewReader(b))
		req.Header["Authorization"] = []string{"Bearer sk_test_demo"}
		if b != nil {
			req.Header["Content-Type"] = []string{"application/json"}
		}
		if key != "" {
			req.Header["Idempotency-Key"] = []string{key}
		}
		if way == "replay" { // a retry, as the load test's: first sent a minute ago
			req.Header["Repeatability-First-Sent"] = []string{sent}
		}
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, req)
		if rec.Code != want {
			return rec, fmt.Errorf("%s %s: %d, want %d: %s", method, route, rec.Code, want, rec.Body)
		}
		return rec, nil
	}
	path := "/v1/" + h.name
	switch way {
	case "first", "article", "unkeyed":
		route := "/" + way + path
		if way == "first" {
			route = "/idem" + path
		}
		for i := range n {
			key := uuid.NewString()
			if way == "unkeyed" {
				key = ""
			}
			if _, err := do(http.MethodPost, route, key, body(i), http.StatusCreated); err != nil {
				return err
			}
		}
		return nil
	case "replay", "read":
	default:
		return fmt.Errorf("-drive %q: want first, article, unkeyed, replay or read", way)
	}
	keys, ids := make([]string, 20), make([]string, 20)
	for i := range keys {
		route, key := "/idem"+path, uuid.NewString()
		if way == "read" {
			route, key = "/unkeyed"+path, ""
		}
		rec, err := do(http.MethodPost, route, key, body(i), http.StatusCreated)
		if err != nil {
			return err
		}
		var out struct{ ID int64 }
		if err := json.Unmarshal(rec.Body.Bytes(), &out); err != nil {
			return err
		}
		keys[i], ids[i] = key, strconv.FormatInt(out.ID, 10)
	}
	for i := range n {
		var err error
		if way == "read" {
			_, err = do(http.MethodGet, "/read"+path+"/"+ids[i%20], "", nil, http.StatusOK)
		} else {
			_, err = do(http.MethodPost, "/idem"+path, keys[i%20], body(i%20), http.StatusCreated)
		}
		if err != nil {
			return err
		}
	}
	return nil
}
