package pgstore_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemkit/idem/server/internal/keysql"
)

// TestClaimStatementsReturnTypedColumns checks that every statement whose
// row the stores read as a keysql.ClaimRow returns each column in the type
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
	for name, sql := range map[string]string{
		"ClaimSQL":     keysql.ClaimSQL,
		"ClaimReadSQL": keysql.ClaimReadSQL,
		"ClaimPeekSQL": keysql.ClaimPeekSQL,
	} {
		sd, err := conn.Conn().Prepare(context.Background(), "", sql)
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
