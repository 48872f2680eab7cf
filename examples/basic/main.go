// Command basic creates a payment with an existing http.Client made safe to
// retry by idem.Transport: every retry of the POST sends the same
// Idempotency-Key, so a lost response never becomes a second payment.
package main

import (
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

func main() {
	api := apiURL() // the -url flag, or a reference server started in process (demo.go)

	// The application's http.Client, its transport wrapped: that is all.
	client := &http.Client{Timeout: time.Minute}
	client.Transport = &idem.Transport{Base: client.Transport}

	body := strings.NewReader(`{"amount": 4200, "currency": "usd", "customer": "cus_123"}`)
	req, err := http.NewRequest(http.MethodPost, api+"/v1/payments", body)
	if err != nil {
		log.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer sk_test_demo")
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req) // retried on timeouts, dropped connections and 5xx
	if err != nil {
		log.Fatal(err) // outcome unknown: retry later with the same key (idem.WithKey)
	}
	defer resp.Body.Close()
	fmt.Println(resp.Status, "Idempotency-Key:", resp.Header.Get("Idempotency-Key"))
	io.Copy(os.Stdout, resp.Body)
}
