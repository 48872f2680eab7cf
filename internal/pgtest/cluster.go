//go:build unix

package pgtest

import "github.com/idemkit/idem/internal/pgcluster"

// The cluster started by [startCluster] for this process. It is referenced
// here so the pipe that keeps it alive is never closed by a finalizer.
var fallback *pgcluster.Cluster

// startCluster starts this process's throwaway cluster, on a Unix socket
// only, and returns its connection string. It is called at most once, by
// discover. The cluster is stopped and deleted when the process exits.
func startCluster() (string, error) {
	c, err := pgcluster.Start(pgcluster.Config{})
	if err != nil {
		return "", err
	}
	fallback = c
	return fallback.URL(), nil
}
