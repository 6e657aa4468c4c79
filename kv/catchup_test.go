package kv_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/kv"
)

// heldWatch returns a Config whose OnUpdate blocks the watch goroutine when it applies the key
// "barrier", until release is called; reached is closed when it blocks the first time. Every
// update after the barrier is then not applied until release. Callers register release with
// t.Cleanup after run's cleanup, so that it runs first and run's wait for the watch can end.
func heldWatch(t *testing.T) (cfg kv.Config, reached <-chan struct{}, release func()) {
	t.Helper()
	hit, gate := make(chan struct{}), make(chan struct{})
	var hitOnce, gateOnce sync.Once
	release = func() { gateOnce.Do(func() { close(gate) }) }
	cfg = kv.Config{
		RetryMin:      10 * time.Millisecond,
		RetryMax:      50 * time.Millisecond,
		CheckInterval: 50 * time.Millisecond,
		OnUpdate: func(u kv.Update) {
			if u.Device == "barrier" {
				hitOnce.Do(func() { close(hit) })
				<-gate
			}
		},
	}
	return cfg, hit, release
}

// catchUp runs tb.CatchUp on its own goroutine and returns the channel of its result.
func catchUp(ctx context.Context, tb *kv.Table) <-chan error {
	done := make(chan error, 1)
	go func() { done <- tb.CatchUp(ctx) }()
	return done
}

// notWithin fails the test if done delivers anything within d.
func notWithin(t *testing.T, done <-chan error, d time.Duration) {
	t.Helper()
	select {
	case err := <-done:
		t.Fatalf("CatchUp() = %v while the watch was held, want it to block", err)
	case <-time.After(d):
	}
}

func within(t *testing.T, done <-chan error, d time.Duration) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(d):
		t.Fatalf("CatchUp did not return within %v", d)
		return nil
	}
}

func TestCatchUpWaitsForRevision(t *testing.T) {
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	b := createBucket(t, js)
	put(t, b, "dev-1", "group-a")
	cfg, reached, release := heldWatch(t)
	tb := newTable(t, b, cfg)
	run(t, tb)
	t.Cleanup(release)
	waitReady(t, tb)

	put(t, b, "barrier", "x")
	<-reached
	put(t, b, "dev-2", "group-b")
	rev := put(t, b, "dev-1", "group-c")
	done := catchUp(context.Background(), tb)
	// The watch is parked on the barrier: nothing after it can be applied, so CatchUp must
	// still be waiting after a long look.
	notWithin(t, done, 500*time.Millisecond)
	release()
	if err := within(t, done, wait); err != nil {
		t.Fatalf("CatchUp() = %v, want nil", err)
	}
	// No polling: the revision awaited is applied by the time CatchUp returns.
	if err := hasEntry(tb, "dev-1", kv.Entry{Group: "group-c", Revision: rev})(); err != nil {
		t.Fatal(err)
	}
	if err := hasEntry(tb, "dev-2", kv.Entry{Group: "group-b", Revision: rev - 1})(); err != nil {
		t.Fatal(err)
	}
}

func TestCatchUpWhenCaughtUp(t *testing.T) {
	tests := map[string]func(t *testing.T, b jetstream.KeyValue){
		"empty bucket": func(*testing.T, jetstream.KeyValue) {},
		"values":       func(t *testing.T, b jetstream.KeyValue) { put(t, b, "dev-1", "group-a") },
		// The last message is a marker: it counts as applied although no device holds it.
		"delete marker last": func(t *testing.T, b jetstream.KeyValue) {
			put(t, b, "dev-1", "group-a")
			if err := b.Delete(context.Background(), "dev-1"); err != nil {
				t.Fatalf("Delete: %v", err)
			}
		},
		"purge marker last": func(t *testing.T, b jetstream.KeyValue) {
			put(t, b, "dev-1", "group-a")
			if err := b.Purge(context.Background(), "dev-1"); err != nil {
				t.Fatalf("Purge: %v", err)
			}
		},
	}
	for name, fill := range tests {
		t.Run(name, func(t *testing.T) {
			srv := natstest.Start(t)
			_, js := srv.JetStream(t)
			b := createBucket(t, js)
			fill(t, b)
			tb := newTable(t, b, kv.Config{})
			run(t, tb)
			waitReady(t, tb)
			start := time.Now()
			// A deadline well past the check interval (1s): returning in time means it did not
			// depend on a re-watch.
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			if err := tb.CatchUp(ctx); err != nil {
				t.Fatalf("CatchUp() = %v after %v, want nil", err, time.Since(start))
			}
		})
	}
}

// A table that never loads never catches up: CatchUp waits until ctx ends and says what it awaited.
func TestCatchUpCancelled(t *testing.T) {
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	b := createBucket(t, js)
	rev := put(t, b, "dev-1", "group-a")
	tb := newTable(t, b, kv.Config{}) // never run
	ctx, cancel := context.WithCancel(context.Background())
	done := catchUp(ctx, tb)
	notWithin(t, done, 200*time.Millisecond)
	cancel()
	err := within(t, done, wait)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("CatchUp() = %v, want context.Canceled", err)
	}
	if !strings.Contains(err.Error(), "revision "+strconv.FormatUint(rev, 10)) {
		t.Errorf("CatchUp() = %q, want it to name the revision awaited (%d)", err, rev)
	}
}

// The stream's last message is gone without a marker (a delete marker removed by
// `nats kv purge-deletes`): no watcher will ever deliver it, and a load that began after it
// is enough.
func TestCatchUpLastMessageRemoved(t *testing.T) {
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	b := createBucket(t, js)
	ctx := context.Background()
	put(t, b, "dev-0", "group-a")
	put(t, b, "dev-1", "group-a")
	if err := b.Delete(ctx, "dev-1"); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	if err := b.PurgeDeletes(ctx, jetstream.DeleteMarkersOlderThan(-1)); err != nil {
		t.Fatalf("PurgeDeletes: %v", err)
	}
	tb := newTable(t, b, kv.Config{})
	run(t, tb)
	waitReady(t, tb)
	if got := tb.Revision(); got != 1 {
		t.Fatalf("Revision() = %d, want 1 (the only message left)", got)
	}
	cctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	if err := tb.CatchUp(cctx); err != nil {
		t.Fatalf("CatchUp() = %v, want nil", err)
	}
}

// A bucket deleted and created again: the revision the table reached in the old bucket is no
// proof of having read the new one, whose revisions start again at 1.
func TestCatchUpBucketRecreated(t *testing.T) {
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	b := createBucket(t, js)
	for i := range 20 {
		put(t, b, "dev-"+strconv.Itoa(i), "group-old")
	}
	// A long check interval: the table notices the new bucket well after CatchUp has asked.
	tb := newTable(t, b, kv.Config{RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond, CheckInterval: time.Second})
	run(t, tb)
	waitReady(t, tb)

	ctx := context.Background()
	if err := js.DeleteKeyValue(ctx, "device-groups"); err != nil {
		t.Fatalf("DeleteKeyValue: %v", err)
	}
	b = createBucket(t, js)
	rev := put(t, b, "dev-1", "group-new")
	cctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	if err := tb.CatchUp(cctx); err != nil {
		t.Fatalf("CatchUp() = %v, want nil", err)
	}
	if err := hasEntry(tb, "dev-1", kv.Entry{Group: "group-new", Revision: rev})(); err != nil {
		t.Fatal(err)
	}
}
