// Package gormtest checks that GORM runs on the transaction sqlstore hands
// a handler, as ordinary repository code does: its writes commit with the
// key's outcome, and its db.Transaction nests as a savepoint. It is a
// module of its own, so that the root module does not require GORM; the
// Makefile's test, vet and staticcheck targets run it.
package gormtest
