package main

import (
	"flag"
	"log"
	"log/slog"
	"net"
	"net/http"

	"github.com/idemkit/idem/server"
)

// apiURL returns the base URL of the payments API to call: the -url flag,
// or else that of the reference server started in this process on the
// in-memory store, with the demo API key sk_test_demo. This is scaffolding
// so the example runs on its own; it is not part of the example.
//
//	go run ./examples/basic                             # in-process reference server
//	go run ./examples/basic -url http://127.0.0.1:8080  # go run ./server/cmd/idem-server
func apiURL() string {
	url := flag.String("url", "", "base `URL` of the payments API (default: a reference server in this process)")
	flag.Parse()
	if *url != "" {
		return *url
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
	return "http://" + ln.Addr().String()
}
