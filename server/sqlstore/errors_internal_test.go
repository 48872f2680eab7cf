package sqlstore

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"testing"

	"github.com/idemkit/idem/server/idempotency"
)

// pgError is a driver's PostgreSQL error, as pgconn.PgError and pq.Error
// are to interpretError: an error with a SQLState method.
type pgError struct{ code string }

func (e *pgError) Error() string    { return "ERROR (SQLSTATE " + e.code + ")" }
func (e *pgError) SQLState() string { return e.code }

// TestInterpretError: a driver's errors are translated by SQLSTATE and
// type, whichever driver wraps them, as pgstore translates pgx's.
func TestInterpretError(t *testing.T) {
	for _, tt := range []struct {
		name      string
		err       error
		want      error // errors.Is of the interpreted error; nil: only the prefix
		retryable bool
	}{
		{"admin shutdown", &pgError{"57P01"}, errConnLost, false},
		{"connection exception", fmt.Errorf("wrapped: %w", &pgError{"08006"}), errConnLost, false},
		{"bad connection", driver.ErrBadConn, errConnLost, false},
		{"EOF", io.EOF, errConnLost, false},
		{"unexpected EOF", fmt.Errorf("read: %w", io.ErrUnexpectedEOF), errConnLost, false},
		{"reset", &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}, errConnLost, false},
		{"invalid text", &pgError{"22021"}, idempotency.ErrInvalidText, false},
		{"serialization failure", &pgError{"40001"}, nil, true},
		{"deadlock", &pgError{"40P01"}, nil, true},
		{"unique violation", &pgError{"23505"}, nil, false},
		{"canceled", fmt.Errorf("query: %w", context.Canceled), context.Canceled, false},
		{"deadline", context.DeadlineExceeded, context.DeadlineExceeded, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got := interpretError(tt.err)
			if !errors.Is(got, tt.err) {
				t.Errorf("interpretError(%v) = %v, which does not reach the driver's error", tt.err, got)
			}
			if tt.want != nil && !errors.Is(got, tt.want) {
				t.Errorf("interpretError(%v) = %v, want it to be %v", tt.err, got, tt.want)
			}
			if lost := errors.Is(got, errConnLost); lost != (tt.want == errConnLost) {
				t.Errorf("interpretError(%v) connection lost: %v", tt.err, lost)
			}
			if r := retryable(got); r != tt.retryable {
				t.Errorf("retryable(%v) = %v, want %v", got, r, tt.retryable)
			}
		})
	}
	if interpretError(nil) != nil {
		t.Error("interpretError(nil) is not nil")
	}
}
