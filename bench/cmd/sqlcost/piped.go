//go:build piped

package main

// Built with -tags piped, every sqlstore on pgx's stdlib pipes its
// transactions (server/sqlstore/pgxpipeline): run the two builds in turn
// to compare them.
import _ "github.com/idemkit/idem/server/sqlstore/pgxpipeline"
