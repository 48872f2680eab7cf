//go:build !unix

package pgtest

import "errors"

// startCluster is not supported off Unix: set IDEM_TEST_DATABASE_URL.
func startCluster() (string, error) {
	return "", errors.New("no throwaway cluster on this platform")
}
