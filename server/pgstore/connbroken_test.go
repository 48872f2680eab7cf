package pgstore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

// TestConnBroken classifies the errors pgx returns when a statement fails:
// only a connection that broke under the statement counts as lost.
func TestConnBroken(t *testing.T) {
	reset := &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"admin shutdown", &pgconn.PgError{Code: "57P01"}, true},
		{"connection exception", &pgconn.PgError{Code: "08006"}, true},
		{"unique violation", &pgconn.PgError{Code: "23505"}, false},
		{"serialization failure", &pgconn.PgError{Code: "40001"}, false},
		{"EOF", io.EOF, true},
		{"unexpected EOF, wrapped", fmt.Errorf("receive message: %w", io.ErrUnexpectedEOF), true},
		{"reset", reset, true},
		{"broken pipe", &net.OpError{Op: "write", Net: "tcp", Err: syscall.EPIPE}, true},
		{"cancelled", context.Canceled, false},
		{"deadline", fmt.Errorf("timeout: %w", context.DeadlineExceeded), false},
		{"cancelled while reading", errors.Join(context.Canceled, reset), false},
		{"connect refused", &pgconn.ConnectError{}, false},
		{"other", errors.New("syntax error"), false},
	} {
		if got := connBroken(tc.err); got != tc.want {
			t.Errorf("connBroken(%s: %v) = %t, want %t", tc.name, tc.err, got, tc.want)
		}
		if got := errors.Is(interpretError(tc.err), errConnLost); got != tc.want {
			t.Errorf("interpretError(%s) is errConnLost: %t, want %t", tc.name, got, tc.want)
		}
	}
}
