package idempotency_test

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"

	"github.com/idemkit/idem/server/idempotency"
)

// Middleware makes a POST route safe to retry: the retry with the same key
// gets the first outcome back, byte for byte, and the handler's write is
// made once. On a MemoryStore the handler stages its write with Stage, so it
// is applied together with the key's stored outcome; on PostgreSQL it would
// write through pgstore.Tx.
func ExampleMiddleware() {
	store := idempotency.NewMemoryStore()
	var mu sync.Mutex
	orders := map[string]string{} // the service's own table: order id -> item

	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var in struct{ Item string }
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.Item == "" {
			http.Error(w, "an item is required", http.StatusBadRequest) // the key stays free
			return
		}
		claim, _ := idempotency.ClaimFromContext(r.Context())
		id := "ord_" + claim.OperationID[:8]
		insert := func() error {
			mu.Lock()
			defer mu.Unlock()
			orders[id] = in.Item
			return nil
		}
		if !store.Stage(r.Context(), insert) {
			insert() // no idempotency key: write at once
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"item": %q}`, in.Item)
	})
	keyed := idempotency.Middleware(store, idempotency.Options{
		Logger: slog.New(slog.DiscardHandler),
		// The service's own authentication scopes the keys.
		ClientID: func(r *http.Request) (string, bool) {
			user, _, ok := r.BasicAuth()
			return user, ok
		},
	})
	mux := http.NewServeMux()
	mux.Handle("POST /orders", keyed(createOrder))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	post := func(key, body string) {
		req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(body))
		req.SetBasicAuth("shop_1", "secret")
		req.Header.Set("Content-Type", "application/json")
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := srv.Client().Do(req)
		if err != nil {
			fmt.Println(err)
			return
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.Header.Get("Content-Type") == "application/problem+json" {
			var p struct{ Type string }
			json.Unmarshal(b, &p)
			fmt.Println(resp.StatusCode, p.Type)
			return
		}
		fmt.Println(resp.StatusCode, strings.TrimSpace(string(b)), "replayed:", resp.Header.Get("Idempotent-Replayed") == "true")
	}
	const key = "8e03978e-40d5-43e8-bc93-6894a57f9324"
	post(key, `{}`)                  // 400: nothing stored, the key stays free
	post(key, `{"item": "book"}`)    // the corrected request runs
	post(key, `{ "item" : "book" }`) // a retry: replayed
	post(key, `{"item": "pen"}`)     // another request with the key: 422
	post("", `{"item": "book"}`)     // no key: 400
	mu.Lock()
	fmt.Println("orders:", len(orders))
	mu.Unlock()
	// Output:
	// 400 an item is required replayed: false
	// 201 {"item": "book"} replayed: false
	// 201 {"item": "book"} replayed: true
	// 422 https://idemkit.dev/problems/idempotency-key-mismatch
	// 400 https://idemkit.dev/problems/idempotency-key-missing
	// orders: 1
}
