package sqlstoretest

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/server/idempotency"
	"github.com/idemkit/idem/server/pgstore"
	"github.com/idemkit/idem/server/sqlstore"
)

// corruptRowsSQL inserts rows that no store writes, which the key table's
// CHECK constraints would refuse (it has none: see keysql's
// schema/keys.sql), one per key corrupt-N: an unknown status, a
// completed key without a response status, one with a status outside 100
// to 599, a started key with a response status.
const corruptRowsSQL = `
INSERT INTO idempotency_keys (client_id, idempotency_key, request_method, request_path, request_hash,
	status, operation_id, lock_token, lease_us, retention_us, response_status)
VALUES ('cli_a', 'corrupt-1', 'POST', '/v1/orders', 'a', 'done', gen_random_uuid(), 1, 0, 0, NULL),
	('cli_a', 'corrupt-2', 'POST', '/v1/orders', 'a', 'completed', gen_random_uuid(), 2, 0, 0, NULL),
	('cli_a', 'corrupt-3', 'POST', '/v1/orders', 'a', 'completed', gen_random_uuid(), 3, 0, 0, 700),
	('cli_a', 'corrupt-4', 'POST', '/v1/orders', 'a', 'started', gen_random_uuid(), 4, 0, 0, 201)`

// testCorruptRows: a key whose row breaks a rule that the key table's
// CHECK constraints kept is an error to a claim of either store (sqlstore
// on driver, pgstore beside it), in a commit of its own and in one
// transaction: never a replay, a 409 or a nil dereference; the rows stay.
func testCorruptRows(t *testing.T, driver string) {
	db, pool := openBeside(t, driver)
	ctx := context.Background()
	_, err := db.ExecContext(ctx, corruptRowsSQL)
	require.NoError(t, err)
	for name, s := range map[string]idempotency.TxClaimer{"sqlstore": sqlstore.New(db), "pgstore": pgstore.New(pool)} {
		for i := 1; i <= 4; i++ {
			for _, oneTx := range []bool{false, true} {
				r := idempotency.ClaimRequest{ClientID: "cli_a", Key: fmt.Sprintf("corrupt-%d", i), Method: "POST",
					Path: "/v1/orders", Fingerprint: []byte("a")}
				claim := s.Claim
				if oneTx {
					claim = s.ClaimInTx
				}
				res, err := claim(ctx, r)
				if err == nil || errors.Is(err, idempotency.ErrFenced) {
					t.Errorf("%s: Claim of %s (one transaction: %v) = %+v, %v; want an error", name, r.Key, oneTx, res, err)
				}
			}
		}
	}
	var n int
	require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM idempotency_keys`).Scan(&n))
	require.Equal(t, 4, n, "rows after the claims")
}
