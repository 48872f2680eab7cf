package pgstore

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// TestAsQueryModeError: the errors of PostgreSQL that shared sessions
// cause become a QueryModeError in the modes that need a session of their
// own, wrapped or not, and keep their PostgreSQL error; other errors, and
// any error in the other modes, are left as they are.
func TestAsQueryModeError(t *testing.T) {
	pgErr := func(code string) error {
		return fmt.Errorf("pgstore: migrate: %w", &pgconn.PgError{Severity: "ERROR", Code: code, Message: "m"})
	}
	for _, tt := range []struct {
		mode pgx.QueryExecMode
		code string
		want bool
	}{
		{pgx.QueryExecModeCacheStatement, "26000", true},
		{pgx.QueryExecModeCacheStatement, "42P05", true},
		{pgx.QueryExecModeCacheStatement, "08P01", false},
		{pgx.QueryExecModeCacheStatement, "23505", false},
		{pgx.QueryExecModeDescribeExec, "26000", true},
		{pgx.QueryExecModeDescribeExec, "08P01", true},
		{pgx.QueryExecModeExec, "26000", false},
		{pgx.QueryExecModeSimpleProtocol, "42P05", false},
		{pgx.QueryExecModeCacheDescribe, "26000", false},
	} {
		in := pgErr(tt.code)
		got := asQueryModeError(tt.mode, in)
		var qm *QueryModeError
		if errors.As(got, &qm) != tt.want {
			t.Errorf("%v, %s: %v; want a QueryModeError: %v", tt.mode, tt.code, got, tt.want)
			continue
		}
		var pe *pgconn.PgError
		if !errors.As(got, &pe) || pe.Code != tt.code {
			t.Errorf("%v, %s: %v does not unwrap to the PostgreSQL error", tt.mode, tt.code, got)
		}
		if tt.want && (qm.Mode != tt.mode || strings.Count(got.Error(), "\n") != 0 ||
			!strings.Contains(got.Error(), "default_query_exec_mode=exec") || !strings.Contains(got.Error(), tt.code)) {
			t.Errorf("%v, %s: %q; want one line naming the mode's fix and the SQLSTATE", tt.mode, tt.code, got)
		}
	}
	if err := asQueryModeError(pgx.QueryExecModeCacheStatement, errors.New("not PostgreSQL")); errors.As(err, new(*QueryModeError)) {
		t.Errorf("an error without a SQLSTATE became %v", err)
	}
}
