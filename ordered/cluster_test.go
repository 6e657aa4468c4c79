package ordered_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/ordered"
)

// TestFenceInProcessIsNotARefusal: on a cluster, while a message checking a fence is in process
// (its proposal not yet applied: here a leader cut off from its followers), the stream refuses
// every other message checking the same fence at once with "wrong last sequence" (10164). That
// refusal is not the message's: the writer must send it again once the stream can store, not
// hand it to Redirect as refused (the lanes made such messages dead letters in UNMAPPED while
// OUTGOING stored them too: TestNetOwnerServerInTheMinority saw 94). A message of the test's
// own, on another subject but checking the writer's fence, is what stays in process. Every
// message of the writer must be stored once, in order, and Redirect never called.
func TestFenceInProcessIsNotARefusal(t *testing.T) {
	const fence = "kvmapper.fence.OUTGOING.3"
	c := natstest.StartCluster(t, 3)
	admin, err := jetstream.New(c.Connect(t, 0))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := admin.CreateStream(ctx, jetstream.StreamConfig{Name: "OUTGOING", Subjects: []string{"outgoing.>", "kvmapper.fence.>"},
		Replicas: 3, Duplicates: 2 * time.Minute, AllowAtomicPublish: true}); err != nil {
		t.Fatal(err)
	}
	own, err := admin.Publish(ctx, fence, []byte(`{"epoch":1}`), jetstream.WithExpectLastSequencePerSubject(0))
	if err != nil {
		t.Fatal(err)
	}
	leader := c.WaitStreamLeader("OUTGOING", -1, 30*time.Second)
	c.WaitStreamCurrent("OUTGOING", 30*time.Second)
	c.CutRoutes(leader)
	t.Cleanup(func() { c.MendRoutes(leader) })
	// Checks of the fence from another connection to the cut-off leader, until one is refused
	// for another in process.
	other := c.Connect(t, leader)
	natstest.Eventually(t, 10*time.Second, func() error {
		m := nats.NewMsg("outgoing.other")
		m.Header.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(own.Sequence, 10))
		m.Header.Set(jetstream.ExpectedLastSubjSeqSubjHeader, fence)
		a, err := other.RequestMsg(m, 200*time.Millisecond)
		if err != nil {
			return err // in process itself, or not yet taken
		}
		if !strings.Contains(string(a.Data), "10164") {
			return fmt.Errorf("the check of the fence was answered %s, want 10164", a.Data)
		}
		return nil
	})
	d := newDriver(t, c.Connect(t, leader), []ordered.Stream{{Name: "OUTGOING", Mode: ordered.ModeAtomic}},
		ordered.Config{PublishTimeout: 500 * time.Millisecond})
	d.w.SetFence(0, fence, own.Sequence)
	var refused []error
	d.hooks.Redirect = func(m *ordered.Msg) bool {
		refused = append(refused, m.Err)
		return true
	}
	inProcess := false
	d.hooks.Round = func(first error, _ int, _ time.Duration) {
		if !inProcess && first != nil && strings.Contains(first.Error(), "(10164)") {
			inProcess = true // the fault struck the writer: now let the stream store again
			c.MendRoutes(leader)
		}
	}
	ms := msgs(1, 200)
	if err := d.run(ms, 20); err != nil {
		t.Fatalf("run = %v, want every message stored", err)
	}
	if !inProcess {
		t.Fatal("no publish of the writer was refused for a fence in process: the fault struck at no moment that matters")
	}
	if len(refused) > 0 {
		t.Errorf("Redirect saw %d refusals (first %v): a fence in process is not the message's refusal", len(refused), refused[0])
	}
	var got []string
	for _, id := range idsOfStream(t, admin, "OUTGOING") {
		if id != "" {
			got = append(got, id)
		}
	}
	if want := idsOf(ms); !slices.Equal(got, want) {
		t.Fatalf("OUTGOING holds %d messages of the writer %v, want each of the %d once, in order", len(got), got, len(want))
	}
}

// idsOfStream returns the Nats-Msg-Id of every message stream holds, in order ("" for none: the
// fence record).
func idsOfStream(t *testing.T, js jetstream.JetStream, stream string) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for seq := info.State.FirstSeq; info.State.Msgs > 0 && seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			t.Fatalf("GetMsg(%s, %d): %v", stream, seq, err)
		}
		out = append(out, m.Header.Get("Nats-Msg-Id"))
	}
	return out
}

// TestFencedSinglesGoOneAtATime: a replicated stream written with single publishes (one that
// does not allow atomic batches, or a mode read while the stream elected) and fenced checks
// each publish against the fence record; while one such publish is in process (proposed, not
// yet applied), the stream refuses the next checking the same record (10164), and takes the one
// after it once the first is applied: pipelined, a later message is stored ahead of an earlier
// one. So the writer must not publish one while an earlier one has no answer, and every message
// must be stored once, in order.
//
// A refusal for a fence in process is no sign of pipelining by itself: nats-server 2.15.2 sends
// a message's PubAck from processJetStreamMsg and only then clears the subject's in-process mark
// (jetstream_cluster.go, applyStreamEntries), so a next publish sent on the acknowledgement can
// arrive in between. On a loaded machine it did (once in 300 publishes, in two CI runs of
// 2026-12-07 with another package's tests beside it); the writer resends it, and this test logs
// how often.
func TestFencedSinglesGoOneAtATime(t *testing.T) {
	const fence = "kvmapper.fence.OUTGOING.3"
	c := natstest.StartCluster(t, 3)
	admin, err := jetstream.New(c.Connect(t, 0))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := admin.CreateStream(ctx, jetstream.StreamConfig{Name: "OUTGOING", Subjects: []string{"outgoing.>", "kvmapper.fence.>"},
		Replicas: 3, Duplicates: 2 * time.Minute}); err != nil {
		t.Fatal(err)
	}
	own, err := admin.Publish(ctx, fence, []byte(`{"epoch":1}`), jetstream.WithExpectLastSequencePerSubject(0))
	if err != nil {
		t.Fatal(err)
	}
	leader := c.WaitStreamLeader("OUTGOING", -1, 30*time.Second)
	c.WaitStreamCurrent("OUTGOING", 30*time.Second)
	d := newDriver(t, c.Connect(t, leader), []ordered.Stream{{Name: "OUTGOING", Mode: ordered.ModeSingle}},
		ordered.Config{PublishTimeout: 2 * time.Second})
	d.w.SetFence(0, fence, own.Sequence)
	var inProcess []error
	d.hooks.Round = func(first error, _ int, _ time.Duration) {
		if first != nil && strings.Contains(first.Error(), "(10164)") {
			inProcess = append(inProcess, first)
		}
	}
	// Each publish, as it begins: was an earlier one still without its answer? (The hook runs
	// on the writer's goroutine, which Settled reads.)
	publishes, pipelined := 0, 0
	defer ordered.SetBeforePublish(func() {
		publishes++
		if !d.w.Settled() {
			pipelined++
		}
	})()
	ms := msgs(1, 300)
	if err := d.run(ms, 30); err != nil {
		t.Fatalf("run = %v, want every message stored", err)
	}
	var got []string
	for _, id := range idsOfStream(t, admin, "OUTGOING") {
		if id != "" {
			got = append(got, id)
		}
	}
	if want := idsOf(ms); !slices.Equal(got, want) {
		t.Errorf("OUTGOING holds %d messages of the writer %v, want each of the %d once, in order", len(got), got, len(want))
	}
	if pipelined > 0 {
		t.Errorf("%d of %d publishes began while an earlier one had no answer: the writer had two checks of the fence in flight", pipelined, publishes)
	}
	if len(inProcess) > 0 {
		t.Logf("%d rounds of resends began with a publish refused for a fence in process (first: %v)", len(inProcess), inProcess[0])
	}
}
