package server

import (
	"bufio"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"io"
	"strings"

	"github.com/idemkit/idem/server/idempotency"
)

// ParseSealKeys parses a seal key file, idem-server's -seal-key-file: one
// key a line, its id and its 32 bytes in standard base64, separated by
// spaces or tabs; blank lines and lines starting with # are skipped. The
// first key seals new responses and every key opens what it sealed, so a
// rotation puts the new key on the first line and keeps the old ones below
// it until the responses they sealed have expired. The first line may end
// with the word open-only, which turns sealing off while its keys still
// open what they sealed ([idempotency.SealKey.OpenOnly]):
//
//	# id       key (openssl rand -base64 32)
//	2026-02    q83vEjRWeJq83vEjRWeJq83vEjRWeJq83vEjRWeJq80=
//	2026-01    3q2+796tvu/erb7v3q2+796tvu/erb7v3q2+796tvu8=
//
// It returns the keys in the file's order, ready for
// [idempotency.NewSealKeys], or an error for a line of another shape, an
// id that is not 1 to 64 of A-Z a-z 0-9 . _ -, a key that is not base64 of
// 32 bytes, an id given twice, open-only below the first line, or a file
// without a key. The error names the line and the column, never what
// is written there: a file with its columns swapped, or a secret pasted
// twice, has a secret where an id belongs, and the error goes to logs.
func ParseSealKeys(r io.Reader) ([]idempotency.SealKey, error) {
	var keys []idempotency.SealKey
	seen := make(map[string]int)
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if n == 1 {
			line = strings.TrimPrefix(line, "\ufeff") // a byte order mark, as some editors write
		}
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fields := strings.Fields(line)
		openOnly := len(fields) == 3 && fields[2] == "open-only"
		switch {
		case len(fields) != 2 && !openOnly:
			return nil, fmt.Errorf("server: seal keys, line %d: want two columns, \"id base64-key\", with open-only after them on the first line only; the line has %d", n, len(fields))
		case openOnly && len(keys) > 0:
			return nil, fmt.Errorf("server: seal keys, line %d, column 3: open-only is for the first key, the only one that seals", n)
		}
		id := fields[0]
		secret, err := base64.StdEncoding.DecodeString(fields[1])
		if err != nil || len(secret) != 32 {
			hint := "make one with: openssl rand -base64 32"
			if isSecret(id) {
				hint = "column 1 holds a key: are the columns swapped? The id comes first"
			}
			return nil, fmt.Errorf("server: seal keys, line %d, column 2: the key is not 32 bytes in standard base64 (%s)", n, hint)
		}
		key := idempotency.SealKey{ID: id, Secret: secret, OpenOnly: openOnly}
		if isSecret(id) {
			return nil, fmt.Errorf("server: seal keys, line %d, column 1: the id reads as a 32-byte key; are the columns swapped, or the key pasted twice? The id (2026-01, say) comes first", n)
		}
		if _, err := idempotency.NewSealKeys(key); err != nil {
			// Not wrapped: NewSealKeys names the id, which may be a secret.
			return nil, fmt.Errorf("server: seal keys, line %d, column 1: the id is not 1 to 64 characters out of A-Z a-z 0-9 . _ - (a date such as 2026-01 does well)", n)
		}
		if first, dup := seen[id]; dup {
			return nil, fmt.Errorf("server: seal keys, line %d, column 1: the id is the one on line %d already", n, first)
		}
		seen[id] = n
		keys = append(keys, key)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("server: seal keys: %w", err)
	}
	if len(keys) == 0 {
		return nil, fmt.Errorf("server: seal keys: no key in the file (one a line: id base64-key)")
	}
	return keys, nil
}

// isSecret reports whether s reads as a secret of 32 bytes, in any base64
// alphabet, padded or not, or in hex: the forms a generated key comes in.
// Some of them are also well-formed ids (base64url without padding, hex),
// which would be logged and stored with every sealed response.
func isSecret(s string) bool {
	for _, enc := range []*base64.Encoding{base64.StdEncoding, base64.URLEncoding, base64.RawStdEncoding, base64.RawURLEncoding} {
		if b, err := enc.DecodeString(s); err == nil && len(b) == 32 {
			return true
		}
	}
	b, err := hex.DecodeString(s)
	return err == nil && len(b) == 32
}
