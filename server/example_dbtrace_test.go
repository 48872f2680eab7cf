package server_test

import (
	"context"
	"log"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/server"
)

// DBRoundTrips is installed as the pool's tracer before the pool is made,
// and handed to the server, whose /metrics then counts the round trips
// (idem_db_round_trips_total), as idem-server does.
func ExampleDBRoundTrips() {
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig("postgres://postgres@127.0.0.1:5432/postgres")
	if err != nil {
		log.Fatal(err)
	}
	trips := new(server.DBRoundTrips)
	cfg.ConnConfig.Tracer = trips
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := server.Migrate(ctx, pool); err != nil {
		log.Fatal(err)
	}
	srv, err := server.New(server.Config{Storage: server.NewPostgresStorage(pool).Storage(), DBRoundTrips: trips})
	if err != nil {
		log.Fatal(err)
	}
	defer srv.Close()
	// Serve srv; trips.Total() is also there to read directly.
}
