package election_test

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/election"
)

// openWatcher is a KeyWatcher in the state nats.go leaves one in when the watch's context ends
// between WatchFiltered's Subscribe and its SetClosedHandler: stopped, with Updates never
// closed. Entries still queued in it stand for a callback that was sending when it stopped.
type openWatcher struct {
	updates chan jetstream.KeyValueEntry
	stopped chan struct{}
}

func (w *openWatcher) Updates() <-chan jetstream.KeyValueEntry { return w.updates }
func (w *openWatcher) Stop() error                             { close(w.stopped); return nil }

// A watch whose Updates nats.go never closes must not keep the elector's goroutines (and so
// Run) from returning: stopWatch drains what is queued and then gives up.
func TestStopWatchReturnsWhenUpdatesStaysOpen(t *testing.T) {
	t.Parallel() // waits out lease timers on a server of its own
	w := &openWatcher{updates: make(chan jetstream.KeyValueEntry, 4), stopped: make(chan struct{})}
	for range 4 {
		w.updates <- nil
	}
	done := make(chan struct{})
	go func() {
		election.StopWatch(w)
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatal("stopWatch did not return within a minute of stopping a watch whose Updates stays open")
	}
	select {
	case <-w.stopped:
	default:
		t.Error("stopWatch returned without stopping the watch")
	}
	if n := len(w.updates); n != 0 {
		t.Errorf("stopWatch left %d queued updates undrained", n)
	}
}
