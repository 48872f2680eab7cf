package idempotency

import (
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestRetentionHeaderIsTheKeys: two replicas with different retentions
// on one store. A key completed by the one that keeps keys an hour is
// kept an hour, and the other replica, which keeps its own keys a day,
// says so on its replay, its 409 and its 422: a client that trusted the
// replica's own retention would come back after the key is gone.
func TestRetentionHeaderIsTheKeys(t *testing.T) {
	store := NewMemoryStore()
	entered, release := make(chan struct{}), make(chan struct{})
	short := testHandler(t, store, Options{Retention: time.Hour}, func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Idempotency-Key") == "held" {
			close(entered)
			<-release
		}
		w.WriteHeader(http.StatusCreated)
	})
	long := testHandler(t, store, Options{Retention: 24 * time.Hour}, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	})

	first := serve(t, short, keyed("k1", `{"a":1}`))
	require.Equal(t, http.StatusCreated, first.status)
	assert.Equal(t, "3600", first.header.Get(RetentionHeader))
	replay := serve(t, long, keyed("k1", `{"a":1}`))
	require.True(t, replay.replayed())
	assert.Equal(t, "3600", replay.header.Get(RetentionHeader), "the replay on the replica that keeps keys a day")
	mismatch := serve(t, long, keyed("k1", `{"a":2}`))
	require.Equal(t, http.StatusUnprocessableEntity, mismatch.status)
	assert.Equal(t, "3600", mismatch.header.Get(RetentionHeader), "the 422")

	held := make(chan reply)
	go func() { held <- serve(t, short, keyed("held", `{}`)) }()
	<-entered
	conflict := serve(t, long, keyed("held", `{}`))
	require.Equal(t, http.StatusConflict, conflict.status)
	assert.Equal(t, "3600", conflict.header.Get(RetentionHeader), "the 409")
	close(release)
	<-held
	assert.Equal(t, "86400", serve(t, long, keyed("k2", `{}`)).header.Get(RetentionHeader), "a key of the long replica's own")
}
