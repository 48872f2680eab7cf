package server_test

import (
	"encoding/json"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/idemkit/idem/server"
)

// New serves the reference payments API, here on the in-memory storage: a
// retry with the same Idempotency-Key gets the first payment back, and the
// card is charged once. (The idempotency middleware on its own, in front of
// a service's handler, is shown in package idempotency.)
func ExampleNew() {
	storage := server.NewMemoryStorage()
	srv, err := server.New(server.Config{
		Storage: storage.Storage(),
		APIKeys: map[string]string{"sk_test_demo": "demo"},
		Logger:  slog.New(slog.DiscardHandler),
	})
	if err != nil {
		log.Fatal(err)
	}
	defer srv.Close() // after the HTTP server: it stops the fake card processor
	hs := httptest.NewServer(srv)
	defer hs.Close()

	var first string
	post := func(key, body string) {
		req, _ := http.NewRequest("POST", hs.URL+"/v1/payments", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer sk_test_demo")
		req.Header.Set("Content-Type", "application/json")
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := hs.Client().Do(req)
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
		if first == "" {
			first = string(b)
		}
		fmt.Println(resp.StatusCode, "replayed:", resp.Header.Get("Idempotent-Replayed") == "true", "same payment:", string(b) == first)
	}
	const key = "8e03978e-40d5-43e8-bc93-6894a57f9324"
	post(key, `{"amount": 4200, "currency": "usd", "customer": "cus_123"}`)
	post(key, `{"customer": "cus_123", "currency": "usd", "amount": 4200}`) // the retry: replayed
	post(key, `{"amount": 100, "currency": "usd", "customer": "cus_123"}`)  // another payment: 422
	post("", `{"amount": 4200, "currency": "usd", "customer": "cus_123"}`)  // no key: 400
	fmt.Println("payments:", len(storage.Payments()), "charges:", len(storage.Charges()))
	// Output:
	// 201 replayed: false same payment: true
	// 201 replayed: true same payment: true
	// 422 https://idemkit.dev/problems/idempotency-key-mismatch
	// 400 https://idemkit.dev/problems/idempotency-key-missing
	// payments: 1 charges: 1
}
