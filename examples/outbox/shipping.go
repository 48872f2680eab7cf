package main

import (
	"bytes"
	"fmt"
	"io"
	"maps"
	"net/http"
	"sync"
	"time"
)

// shippingAPI is a fake shipping provider that honours Idempotency-Key as
// payment APIs do: POST /v1/shipments makes one shipment per key, answers a
// repeated key with its first answer (Idempotent-Replayed: true), and a key
// sent again with another body with 422. It records every shipment it made,
// by key, so that a test can count the effects. The program runs one in
// process when no -shipping-url is given; its methods are safe for
// concurrent use.
type shippingAPI struct {
	// latency is how long a new shipment takes to answer, after it is made:
	// a process that dies meanwhile has shipped without knowing it.
	latency time.Duration
	// loseEvery, if above zero, loses the first answer of every loseEvery-th
	// new shipment (the connection is closed once the shipment is made), so
	// that the caller must ask again with the same key.
	loseEvery int

	mu        sync.Mutex
	shipments map[string]shipped // by Idempotency-Key
	replays   int                // answers to a key already shipped
	lost      int                // answers lost on purpose
}

// shipped is one shipment and the request that made it.
type shipped struct {
	ID   string
	Body []byte
}

func (s *shippingAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != "/v1/shipments" {
		http.NotFound(w, r)
		return
	}
	key := r.Header.Get("Idempotency-Key")
	body, err := io.ReadAll(r.Body)
	if key == "" || err != nil {
		http.Error(w, "an Idempotency-Key and a body are required", http.StatusBadRequest)
		return
	}
	id, n, ok := s.ship(key, body)
	if !ok {
		http.Error(w, "Idempotency-Key already used for another shipment", http.StatusUnprocessableEntity)
		return
	}
	if n > 0 {
		time.Sleep(s.latency)
		if s.loseEvery > 0 && n%s.loseEvery == 0 && s.lose(w) {
			return
		}
	} else {
		w.Header().Set("Idempotent-Replayed", "true")
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"id":%q}`+"\n", id)
}

// ship makes the shipment of key and returns its number (1 for the first),
// or finds the one it already made and returns 0. ok is false when key was
// used with another body.
func (s *shippingAPI) ship(key string, body []byte) (id string, n int, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if old, found := s.shipments[key]; found {
		if !bytes.Equal(old.Body, body) {
			return "", 0, false
		}
		s.replays++
		return old.ID, 0, true
	}
	if s.shipments == nil {
		s.shipments = make(map[string]shipped)
	}
	n = len(s.shipments) + 1
	id = fmt.Sprintf("shp_%d", n)
	s.shipments[key] = shipped{ID: id, Body: body}
	return id, n, true
}

// lose closes the connection without an answer, and reports whether it
// could.
func (s *shippingAPI) lose(w http.ResponseWriter) bool {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		return false
	}
	// Counted before the close: the caller learns of the loss from the
	// close, and may look at the count the moment it does.
	s.mu.Lock()
	s.lost++
	s.mu.Unlock()
	conn.Close()
	return true
}

// snapshot returns a copy of the shipments by key, and the numbers of
// replayed and lost answers.
func (s *shippingAPI) snapshot() (shipments map[string]shipped, replays, lost int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.shipments), s.replays, s.lost
}
