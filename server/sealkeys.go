package server

import (
	"bufio"
	"encoding/base64"
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
// [idempotency.NewSealKeys], or an error naming the line (never its
// secret) for a line of another shape, an id that is not 1 to 64 of
// A-Z a-z 0-9 . _ -, a key that is not base64 of 32 bytes, an id given
// twice, open-only below the first line, or a file without a key.
func ParseSealKeys(r io.Reader) ([]idempotency.SealKey, error) {
	var keys []idempotency.SealKey
	seen := make(map[string]int)
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fields := strings.Fields(line)
		openOnly := len(fields) == 3 && fields[2] == "open-only"
		switch {
		case len(fields) != 2 && !openOnly:
			return nil, fmt.Errorf("server: seal keys, line %d: want \"id base64-key\", with open-only after it on the first line only", n)
		case openOnly && len(keys) > 0:
			return nil, fmt.Errorf("server: seal keys, line %d: open-only is for the first key, the only one that seals", n)
		}
		id := fields[0]
		if first, dup := seen[id]; dup {
			return nil, fmt.Errorf("server: seal keys, line %d: key id %q is on line %d already", n, id, first)
		}
		secret, err := base64.StdEncoding.DecodeString(fields[1])
		if err != nil || len(secret) != 32 {
			return nil, fmt.Errorf("server: seal keys, line %d: key %q is not 32 bytes in standard base64 (make one with: openssl rand -base64 32)", n, id)
		}
		key := idempotency.SealKey{ID: id, Secret: secret, OpenOnly: openOnly}
		if _, err := idempotency.NewSealKeys(key); err != nil {
			return nil, fmt.Errorf("server: seal keys, line %d: %w", n, err)
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
