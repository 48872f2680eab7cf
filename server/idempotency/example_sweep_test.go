package idempotency_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"

	"github.com/idemkit/idem/server/idempotency"
)

// A Sweeper settles the operations whose clients never came back. Here a
// handler charges a card (a downstream call keyed by its operation) and
// then fails before it records the order; its client gives up. The
// sweeper's hook finds the charge under the operation, records the order
// in the key's unit of work, and completes the key with the answer the
// client would have had: a retry, whenever it comes, gets it.
func ExampleSweeper() {
	store := idempotency.NewMemoryStore()
	var mu sync.Mutex
	charges := map[string]string{} // the card processor's: operation -> item
	orders := map[string]string{}  // the service's own table: order id -> item

	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		claim, _ := idempotency.ClaimFromContext(r.Context())
		item, _ := io.ReadAll(r.Body)
		mu.Lock()
		charges[claim.OperationID] = string(item)
		mu.Unlock()
		http.Error(w, "the order table is unavailable", http.StatusServiceUnavailable)
	})
	settle := func(ctx context.Context, k idempotency.KeyInfo) (idempotency.Settlement, error) {
		mu.Lock()
		item, charged := charges[k.OperationID]
		mu.Unlock()
		if !charged {
			return idempotency.Settlement{Release: true}, nil // nothing was done
		}
		id := "ord_" + k.OperationID[:8]
		store.Stage(ctx, func() error {
			mu.Lock()
			defer mu.Unlock()
			orders[id] = item
			return nil
		})
		return idempotency.Settlement{Response: &idempotency.StoredResponse{
			Status:      http.StatusCreated,
			ContentType: "text/plain",
			Body:        []byte(item + " ordered"),
		}}, nil
	}

	keyed := idempotency.Middleware(store, idempotency.Options{
		Logger:   slog.New(slog.DiscardHandler),
		ClientID: func(*http.Request) (string, bool) { return "shop_1", true },
	})
	srv := httptest.NewServer(keyed(createOrder))
	defer srv.Close()
	post := func() {
		req, _ := http.NewRequest("POST", srv.URL, strings.NewReader("book"))
		req.Header.Set("Content-Type", "text/plain")
		req.Header.Set("Idempotency-Key", "8e03978e-40d5-43e8-bc93-6894a57f9324")
		resp, err := srv.Client().Do(req)
		if err != nil {
			fmt.Println(err)
			return
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		fmt.Println(resp.StatusCode, strings.TrimSpace(string(b)), "replayed:", resp.Header.Get("Idempotent-Replayed") == "true")
	}

	post() // charged, then failed: the key is released, its operation kept

	sweeper := &idempotency.Sweeper{
		Store:  store,
		Settle: settle,
		Grace:  1, // a nanosecond, for the example: normally a minute for the client's retries
		Logger: slog.New(slog.DiscardHandler),
	}
	res, err := sweeper.Sweep(context.Background())
	fmt.Printf("swept: %+v %v\n", res, err)
	mu.Lock()
	fmt.Println("orders:", len(orders))
	mu.Unlock()

	post() // the client comes back after all
	// Output:
	// 503 the order table is unavailable replayed: false
	// swept: {Found:1 Completed:1 Released:0 Left:0 Lost:0} <nil>
	// orders: 1
	// 201 book ordered replayed: true
}
