// Command basic creates a payment with an existing http.Client made safe to
// retry by idem.Transport: every retry of the POST sends the same
// Idempotency-Key, so a lost response never becomes a second payment. The
// key is made before the first call and stored with the order, so a call
// that ends with its outcome unknown can be finished later, even by another
// process, without paying twice.
package main

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"strings"

	"github.com/idemkit/idem"
)

func main() {
	cfg := setup() // -url, -key, -deadline, and a reference server in process without -url (demo.go)

	// The application's http.Client, its transport wrapped: that is all.
	// It has no Timeout: on a timeout net/http replaces the Transport's
	// error with its own, which no longer names the key to retry with.
	client := &http.Client{}
	client.Transport = &idem.Transport{Base: client.Transport}

	// The payment's key: made once and stored with the order before the
	// first call (here it is printed, and -key reads it back).
	key := cmp.Or(cfg.key, idem.NewKey())
	fmt.Println("payment key:", key)

	// The whole operation's deadline, retries included, on the context.
	ctx, cancel := context.WithTimeout(idem.WithKey(context.Background(), key), cfg.deadline)
	defer cancel()
	body := strings.NewReader(`{"amount": 4200, "currency": "usd", "customer": "cus_123"}`)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, cfg.url+"/v1/payments", body)
	if err != nil {
		log.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer sk_test_demo")
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req) // retried on timeouts, dropped connections and 5xx, always with this key
	if err != nil {
		log.Fatalf("outcome unknown: run again with -key %s: %v", key, err) // never with a new key
	}
	defer resp.Body.Close()
	replayed := ""
	if idem.Replayed(resp) {
		replayed = " (replayed)" // the key's first outcome: no second payment
	}
	fmt.Println(resp.Status, "Idempotency-Key:", resp.Header.Get("Idempotency-Key")+replayed)
	io.Copy(os.Stdout, resp.Body)
}
