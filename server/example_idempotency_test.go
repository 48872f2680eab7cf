package server_test

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/idemkit/idem/server"
)

// Idempotency makes a POST route safe to retry: the retry with the same key
// gets the first outcome back, and the handler runs once.
func ExampleIdempotency() {
	orders := 0
	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		orders++
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"order": %d}`, orders)
	})
	keyed := server.Idempotency(server.NewMemoryStore(), server.IdempotencyOptions{
		Logger: slog.New(slog.DiscardHandler),
	})
	auth := server.BearerAuth(map[string]string{"sk_test_demo": "demo"})
	mux := http.NewServeMux()
	mux.Handle("POST /v1/orders", auth(keyed(createOrder)))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	post := func(key, body string) {
		req, _ := http.NewRequest("POST", srv.URL+"/v1/orders", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer sk_test_demo")
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
			var p server.Problem
			json.Unmarshal(b, &p)
			fmt.Println(resp.StatusCode, p.Type)
			return
		}
		fmt.Println(resp.StatusCode, string(b), "replayed:", resp.Header.Get("Idempotent-Replayed") == "true")
	}
	post("8e03978e-40d5-43e8-bc93-6894a57f9324", `{"item": "book"}`)
	post("8e03978e-40d5-43e8-bc93-6894a57f9324", `{ "item" : "book" }`) // a retry: replayed
	post("8e03978e-40d5-43e8-bc93-6894a57f9324", `{"item": "pen"}`)     // another request: 422
	post("", `{"item": "book"}`)                                        // no key: 400
	fmt.Println("orders created:", orders)
	// Output:
	// 201 {"order": 1} replayed: false
	// 201 {"order": 1} replayed: true
	// 422 https://idemkit.dev/problems/idempotency-key-mismatch
	// 400 https://idemkit.dev/problems/idempotency-key-missing
	// orders created: 1
}
