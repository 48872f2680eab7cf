package main

import (
	"flag"
	"log"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/idemkit/idem/server"
)

// config is what the flags ask for.
type config struct {
	url      string        // base URL of the payments API
	key      string        // the payment's stored key; "": a new one
	deadline time.Duration // of the whole operation, retries included
}

// setup reads the flags and returns the configuration. Without -url it
// starts the reference server in this process, on the in-memory store,
// with the demo API key sk_test_demo, and calls it. This is scaffolding so
// the example runs on its own; it is not part of the example.
//
//	go run ./examples/basic                             # in-process reference server
//	go run ./examples/basic -url http://127.0.0.1:8080  # go run ./server/cmd/idem-server
//	go run ./examples/basic -url http://127.0.0.1:8080 -key K  # K from a failed run: finish it
func setup() config {
	var cfg config
	flag.StringVar(&cfg.url, "url", "", "base `URL` of the payments API (default: a reference server in this process)")
	flag.StringVar(&cfg.key, "key", "", "the payment's `key`, printed by an earlier run whose outcome is unknown (default: a new key)")
	flag.DurationVar(&cfg.deadline, "deadline", time.Minute, "how long the payment may take, retries included")
	flag.Parse()
	if cfg.url != "" {
		return cfg
	}
	srv, err := server.New(server.Config{
		Storage: server.NewMemoryStorage().Storage(),
		APIKeys: map[string]string{"sk_test_demo": "demo"},
		Logger:  slog.New(slog.DiscardHandler),
	})
	if err != nil {
		log.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	go http.Serve(ln, srv) // runs until the program exits
	cfg.url = "http://" + ln.Addr().String()
	return cfg
}
