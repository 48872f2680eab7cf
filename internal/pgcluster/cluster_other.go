//go:build !unix

package pgcluster

import (
	"context"
	"errors"
)

var errUnsupported = errors.New("pgcluster: no throwaway clusters on this platform")

// Config says how to start a cluster; see the Unix build.
type Config struct {
	TCP      bool
	Settings []string
}

// Cluster is a running cluster; none can be started on this platform.
type Cluster struct{}

// Available reports that clusters cannot be started on this platform.
func Available() error { return errUnsupported }

// Start returns an error on this platform.
func Start(Config) (*Cluster, error) { return nil, errUnsupported }

func (c *Cluster) StartStandby(Config) (*Cluster, error) { return nil, errUnsupported }
func (c *Cluster) URL() string                           { return "" }
func (c *Cluster) Host() string                          { return "" }
func (c *Cluster) Port() int                             { return 0 }
func (c *Cluster) Dir() string                           { return "" }
func (c *Cluster) LogPath() string                       { return "" }
func (c *Cluster) Kill() error                           { return errUnsupported }
func (c *Cluster) Promote(context.Context) error         { return errUnsupported }
func (c *Cluster) Stop() error                           { return nil }
