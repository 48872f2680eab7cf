package pgstore_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemkit/idem/server/internal/keysql"
)

// TestClaimStatementsReturnTypedColumns checks that every statement whose
// row the stores read as a keysql.ClaimRow (or PeekRow) returns each column in the type
// of its field. A bare NULL is text to PostgreSQL: pgx finds no plan to
// scan text into an *int64 and, for a NULL, tries every type it knows,
// which made a replay cost twice the instructions it costs now.
func TestClaimStatementsReturnTypedColumns(t *testing.T) {
	_, pool := newStore(t, nil)
	want := []uint32{pgtype.Int4OID, pgtype.Int8OID, pgtype.TextOID,
		pgtype.TextOID, pgtype.TextOID, pgtype.ByteaOID, pgtype.TextOID,
		pgtype.Int4OID, pgtype.TextOID, pgtype.JSONBOID, pgtype.ByteaOID, pgtype.TimestamptzOID, pgtype.TimestamptzOID,
		pgtype.Int8OID, pgtype.BoolOID, pgtype.BoolOID}
	if n := len(new(keysql.ClaimRow).Dests(nil)); n != len(want) {
		t.Fatalf("a claim row has %d columns; this test knows the types of %d", n, len(want))
	}
	conn, err := pool.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	peek := []uint32{pgtype.TextOID, pgtype.TextOID, pgtype.TextOID, pgtype.ByteaOID, pgtype.TextOID,
		pgtype.Int4OID, pgtype.TextOID, pgtype.JSONBOID, pgtype.ByteaOID,
		pgtype.TimestamptzOID, pgtype.TimestamptzOID, pgtype.Int8OID, pgtype.Int8OID, pgtype.TimestamptzOID, pgtype.BoolOID,
		pgtype.TimestamptzOID}
	if n := len(new(keysql.PeekRow).Dests(nil)); n != len(peek) {
		t.Fatalf("a peek row has %d columns; this test knows the types of %d", n, len(peek))
	}
	for _, st := range []struct {
		name, sql string
		want      []uint32
	}{
		{"ClaimSQL", keysql.ClaimSQL, want},
		{"ClaimReadSQL", keysql.ClaimReadSQL, want},
		{"ClaimPeekSQL", keysql.ClaimPeekSQL, peek},
	} {
		name, want := st.name, st.want
		sd, err := conn.Conn().Prepare(context.Background(), "", st.sql)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if len(sd.Fields) != len(want) {
			t.Errorf("%s returns %d columns, want %d", name, len(sd.Fields), len(want))
			continue
		}
		for i, f := range sd.Fields {
			if f.DataTypeOID != want[i] {
				t.Errorf("%s: column %d (%s) has type OID %d, want %d", name, i+1, f.Name, f.DataTypeOID, want[i])
			}
		}
	}
}
