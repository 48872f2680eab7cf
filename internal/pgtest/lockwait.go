package pgtest

import "time"

// WatchLockWait watches, in a goroutine of its own, for sessions of the
// test (at least that many at once) that wait on a lock where the SQL
// condition cond (on pg_stat_activity's columns) holds too, and closes
// waiting when it sees them, or when a query fails, so that a test
// waiting on it never hangs. count runs query, a count, on a session with
// the test's application_name (see [SchemaURL]) and scans it into n; the
// watch calls it every 5ms, from its goroutine only. stop, called once,
// ends the watch and returns the query's error, if one failed.
func WatchLockWait(count func(query string, n *int) error, sessions int, cond string) (waiting <-chan struct{}, stop func() error) {
	query := `SELECT count(*) FROM pg_stat_activity
		WHERE wait_event_type = 'Lock' AND (` + cond + `) AND application_name = current_setting('application_name')`
	seen, quit, done := make(chan struct{}), make(chan struct{}), make(chan struct{})
	var err error
	go func() {
		defer close(done)
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for {
			var n int
			if err = count(query, &n); err != nil || n >= sessions {
				close(seen)
				return
			}
			select {
			case <-quit:
				return
			case <-tick.C:
			}
		}
	}()
	return seen, func() error {
		close(quit)
		<-done
		return err
	}
}
