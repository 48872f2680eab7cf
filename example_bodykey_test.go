package idem_test

import (
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/idemkit/idem"
)

// An API that takes the key in a header of another name, as PayPal takes
// PayPal-Request-Id: set KeyHeader.
func ExampleTransport_headerName() {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Println("PayPal-Request-Id is set:", r.Header.Get("PayPal-Request-Id") != "")
		fmt.Println("Idempotency-Key is set:", r.Header.Get("Idempotency-Key") != "")
		w.WriteHeader(http.StatusCreated)
	}))
	defer srv.Close()

	client := &http.Client{Transport: &idem.Transport{KeyHeader: "PayPal-Request-Id"}}
	resp, err := client.Post(srv.URL+"/v2/checkout/orders", "application/json",
		strings.NewReader(`{"intent":"CAPTURE"}`))
	if err != nil {
		log.Fatal(err)
	}
	resp.Body.Close()
	fmt.Println(resp.Status)
	// Output:
	// PayPal-Request-Id is set: true
	// Idempotency-Key is set: false
	// 201 Created
}

// An API that takes the key in a field of the JSON body, as Square takes
// idempotency_key: set KeyBodyField. The field is written first into the
// object, the other bytes are sent as they were, and no key header is sent.
// A body that already has the field keeps it: its value is the key.
func ExampleTransport_bodyField() {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var payment struct {
			IdempotencyKey string `json:"idempotency_key"`
		}
		if err := json.Unmarshal(body, &payment); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		shown := string(body)
		if len(payment.IdempotencyKey) == 36 { // a UUID made by idem
			shown = strings.Replace(shown, payment.IdempotencyKey, "<new UUID>", 1)
		}
		fmt.Println("server saw:", shown)
		fmt.Println("Idempotency-Key is set:", r.Header.Get("Idempotency-Key") != "")
		w.WriteHeader(http.StatusOK)
	}))
	defer srv.Close()

	client := &http.Client{Transport: &idem.Transport{KeyBodyField: "idempotency_key"}}
	for _, body := range []string{
		`{"source_id": "cnon:card-nonce-ok", "amount_money": {"amount": 100, "currency": "USD"}}`,
		`{"idempotency_key": "order-1234", "source_id": "cnon:card-nonce-ok"}`,
	} {
		resp, err := client.Post(srv.URL+"/v2/payments", "application/json", strings.NewReader(body))
		if err != nil {
			log.Fatal(err)
		}
		resp.Body.Close()
	}
	// Output:
	// server saw: {"idempotency_key":"<new UUID>","source_id": "cnon:card-nonce-ok", "amount_money": {"amount": 100, "currency": "USD"}}
	// Idempotency-Key is set: false
	// server saw: {"idempotency_key": "order-1234", "source_id": "cnon:card-nonce-ok"}
	// Idempotency-Key is set: false
}
