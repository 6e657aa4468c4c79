package election

import (
	"context"
	"testing"
	"time"
)

// TestLoopDoesNotSpinWhileOwnWritesGoUnheard: this replica's own writes have not been heard for
// 2.5s (the control bucket elects; its watch has stalled), so every other key's judgeable time
// (2s after its last write, "if own writes go on being heard") is past without the key being
// judged. The loop must not wake itself at once for that past time, again and again: over one
// second it passes a handful of times (minWake), not thousands.
func TestLoopDoesNotSpinWhileOwnWritesGoUnheard(t *testing.T) {
	t.Parallel()
	cfg, err := Config{ReplicaID: "a", Partitions: 4, LeaseTTL: 15 * time.Second,
		RenewInterval: 500 * time.Millisecond, JudgedExpiry: 2 * time.Second}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	e := &Elector{cfg: cfg, kick: make(chan struct{}, 1), resync: make(chan struct{}, 1),
		exits: make(chan exit, 4), stopping: make(chan struct{}), holders: map[int]*holder{},
		failures: map[int]int{}, cooldown: map[int]time.Time{}, unanswered: map[int]unanswered{}}
	now := time.Now()
	ago := func(d time.Duration) heard { return heard{seen: now.Add(-d), stored: now.Add(-d)} }
	e.settle.done = true
	e.view.ready = true
	e.view.members = map[string]heard{"a": ago(2500 * time.Millisecond), "b": ago(2500 * time.Millisecond)}
	e.view.own = writable{start: ago(time.Minute), last: ago(2500 * time.Millisecond)}
	for p := range 4 {
		h := ago(2500 * time.Millisecond)
		owner := "b"
		if p < 2 {
			owner = "a"
			e.holders[p] = &holder{release: make(chan struct{})}
		}
		e.view.slots = append(e.view.slots, slot{owner: owner, seen: h.seen, stored: h.stored, rev: uint64(p + 1)})
	}
	if next := e.reconcile(context.Background()); next.IsZero() || !next.Before(time.Now()) {
		t.Fatalf("reconcile asks to be woken at %v: the scenario does not give the past time it is about", next)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	e.loop(ctx)
	if e.passes > 30 {
		t.Fatalf("the loop passed %d times in a second while its own writes went unheard: it spins", e.passes)
	}
	t.Logf("%d passes in a second", e.passes)
}
