// Package pqtest runs the tests of sqlstore on lib/pq's database/sql
// driver ("postgres"). It is a module of its own, so that the root module
// does not require lib/pq; the Makefile's test, vet and staticcheck
// targets run it.
package pqtest
