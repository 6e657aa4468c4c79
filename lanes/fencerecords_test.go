package lanes_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/lanes"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// fenceStream makes stream capture its fence subjects, take atomic batches and roll its fence
// records up, as setup makes a replicated output stream.
func (f *fixture) fenceStream(name string) {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := f.js.Stream(ctx, name)
	if err != nil {
		f.t.Fatal(err)
	}
	c := s.CachedInfo().Config
	c.Subjects = append(c.Subjects, subjects.FenceFilter(name))
	c.AllowAtomicPublish, c.AllowRollup = true, true
	if _, err := f.js.UpdateStream(ctx, c); err != nil {
		f.t.Fatal(err)
	}
}

// fenceRecords returns how many fence records stream holds, by fence subject.
func (f *fixture) fenceRecords(stream string) map[string]uint64 {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := f.js.Stream(ctx, stream)
	if err != nil {
		f.t.Fatal(err)
	}
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(subjects.FenceFilter(stream)))
	if err != nil {
		f.t.Fatal(err)
	}
	return info.State.Subjects
}

// fenceOnce runs partition p's lane under epoch until it has fenced every stream of fenced,
// then stops it.
func fenceOnce(t *testing.T, pool *lanes.Pool, p int, epoch uint64, fenced int) {
	t.Helper()
	stop, res := runLane(t, pool, lanes.Assignment{Partition: p, Epoch: epoch, Owner: fmt.Sprintf("r%d", epoch)})
	natstest.Eventually(t, 10*time.Second, func() error {
		select {
		case err := <-res:
			t.Fatalf("the lane of epoch %d stopped before it fenced its outputs: %v", epoch, err)
		default:
		}
		if n := len(pool.Fences(p)); n != fenced {
			return fmt.Errorf("epoch %d: %d of %d outputs fenced", epoch, n, fenced)
		}
		return nil
	})
	stop()
}

// TestFenceRecordsStayOnePerPartition: every takeover writes a fence record, and the check needs
// only the last: after many takeovers each output stream holds one record per partition, not one
// per takeover (which grew without bound, and in PARKED ran into its per-subject limit).
func TestFenceRecordsStayOnePerPartition(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	fenced := []string{f.names.Outgoing, f.names.Unmapped}
	for _, s := range fenced {
		f.fenceStream(s)
	}
	pool := f.newPool(lanes.Config{Fences: fenced})
	const takeovers = 12
	parts := []int{0, 5}
	for i := range takeovers {
		for _, p := range parts {
			fenceOnce(t, pool, p, uint64(100+i), len(fenced))
		}
	}
	for _, stream := range fenced {
		recs := f.fenceRecords(stream)
		if len(recs) != len(parts) {
			t.Errorf("%s holds fence records on %d subjects (%v), want %d: one per partition taken over", stream, len(recs), recs, len(parts))
		}
		for subj, n := range recs {
			if n != 1 {
				t.Errorf("%s holds %d fence records on %s after %d takeovers, want 1", stream, n, subj, takeovers)
			}
		}
	}
	// The last owner's record is the one kept, and it fences: its lane maps.
	for _, stream := range fenced {
		for _, p := range parts {
			if r, _ := f.record(stream, p); r.Epoch != 100+takeovers-1 {
				t.Errorf("%s: partition %d's record is of epoch %d, want the last takeover's %d", stream, p, r.Epoch, 100+takeovers-1)
			}
		}
	}
}

// fillParked stores n messages of devices no lane runs for in PARKED, whose limit is n in all.
func (f *fixture) fillParked(n int) {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i := range n {
		dev := fmt.Sprintf("filler-%d", i)
		if _, err := f.js.Publish(ctx, subjects.ParkedSubject("parked", subjects.Partition(dev, f.lay.Partitions), dev), []byte("x")); err != nil {
			f.t.Fatalf("filling PARKED: %v", err)
		}
	}
	if _, err := f.js.Publish(ctx, subjects.ParkedSubject("parked", 0, "one-too-many"), []byte("x")); err == nil || !strings.Contains(err.Error(), "maximum messages") {
		f.t.Fatalf("publishing past PARKED's limit: %v, want maximum messages exceeded: the test proves nothing", err)
	}
}

// A full PARKED (discard new, its MaxMsgs reached by parked messages) must not keep a partition
// from ever mapping again: a partition that has a fence record there gets its new owner's record
// all the same, in place of the old one; one that has none cannot be fenced there, and its lane
// gives the partition up at once (Run returns an error wrapping ErrFenceWrite, which its owner
// counts and releases the lease on), rather than retrying for ever while holding the lease.
func TestFullParkedStillFencesOrGivesUp(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	const limit = 20
	cfg := f.parkOn(lanes.Config{}, 5, limit)
	fenced := []string{f.names.Outgoing, f.names.Unmapped, "PARKED"}
	for _, s := range fenced {
		f.fenceStream(s)
	}
	cfg.Fences = fenced
	pool := f.newPool(cfg)
	fenceOnce(t, pool, 3, 10, len(fenced)) // partition 3 has its records; partition 4 none
	f.fillParked(limit - 1)                // the records of partition 3 take one place

	fenceOnce(t, pool, 3, 11, len(fenced))
	if r, _ := f.record("PARKED", 3); r.Epoch != 11 {
		t.Errorf("PARKED: partition 3's record is of epoch %d after a takeover while PARKED was full, want 11", r.Epoch)
	}
	if n := f.fenceRecords("PARKED")[f.fenceSubject("PARKED", 3)]; n != 1 {
		t.Errorf("PARKED holds %d records of partition 3, want 1", n)
	}

	_, res := runLane(t, pool, lanes.Assignment{Partition: 4, Epoch: 12, Owner: "r12"})
	select {
	case err := <-res:
		if !errors.Is(err, lanes.ErrFenceWrite) {
			t.Fatalf("Run of a partition PARKED has no room to fence = %v, want ErrFenceWrite", err)
		}
		if !strings.Contains(err.Error(), "PARKED") {
			t.Errorf("Run() = %v, want the error to name the stream", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the lane of a partition PARKED has no room to fence still holds it 10s later")
	}
}

// fenceOver writes, from outside the pool, a later owner's fence record (epoch) for partition p
// in stream over the last one, as a successor's takeover does, and returns its sequence.
func (f *fixture) fenceOver(stream string, p int, epoch uint64) uint64 {
	f.t.Helper()
	_, last := f.record(stream, p)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	rec := wire.FenceRecord{Partition: p, Epoch: epoch, Owner: "successor", Control: "zzzzzzzzzzzzz", Nonce: "n"}
	m := nats.NewMsg(f.fenceSubject(stream, p))
	m.Data = rec.Append(nil)
	ack, err := f.js.PublishMsg(ctx, m, jetstream.WithExpectLastSequencePerSubject(last))
	if err != nil {
		f.t.Fatalf("writing a successor's fence record: %v", err)
	}
	return ack.Sequence
}

// TestFencedStreamNeverWrittenInFastBatches: a fenced stream that allows fast-ingest batches
// (OUTGOING edited to one replica: allow_batched beside allow_atomic) is written in atomic
// batches all the same, each checking the lane's fence. A fast batch carries no fence: the lane
// went on storing its messages after a successor's record, where a checked write is refused and
// the lane stops (ErrFenced), having stored nothing after it.
func TestFencedStreamNeverWrittenInFastBatches(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	fenced := []string{f.names.Outgoing, f.names.Unmapped}
	for _, s := range fenced {
		f.fenceStream(s)
	}
	dev := "dev-b"
	p := subjects.Partition(dev, f.lay.Partitions)
	f.groups.set(dev, "g")
	pool := f.newPool(lanes.Config{Fences: fenced})
	_, res := runLane(t, pool, lanes.Assignment{Partition: p, Epoch: 10, Owner: "r10"})
	natstest.Eventually(t, 10*time.Second, func() error {
		if len(pool.Fences(p)) != len(fenced) {
			return errors.New("the lane has not fenced its outputs yet")
		}
		return nil
	})
	if modes := pool.WriteModes(); modes[f.names.Outgoing] != "batch" {
		t.Fatalf("OUTGOING's mode %q, want batch (fast ingest) for an unfenced lane: the test proves nothing", modes[f.names.Outgoing])
	}
	f.publish([]string{dev}, 3, nil)
	f.read(f.names.Outgoing, 1+3)
	at := f.fenceOver(f.names.Outgoing, p, 20)
	f.publishFrom([]string{dev}, 3, 3, nil)
	var runErr error
	natstest.Eventually(t, 10*time.Second, func() error {
		select {
		case runErr = <-res:
			return nil
		default:
		}
		if after := f.count(f.names.Outgoing) - 1 - 3 - 1; after > 0 {
			return nil // stored after the successor's record: checked below
		}
		return errors.New("the lane neither stopped nor stored anything after its successor's record")
	})
	for _, m := range f.readFirst(f.names.Outgoing, f.count(f.names.Outgoing)) {
		if md, _ := m.Metadata(); md.Sequence.Stream > at {
			t.Errorf("OUTGOING stored %q (epoch %s) at %d, after the successor's record at %d: a fenced stream was written unchecked",
				m.Data(), epochOf(m.Headers()), md.Sequence.Stream, at)
		}
	}
	if runErr != nil && !errors.Is(runErr, lanes.ErrFenced) {
		t.Errorf("Run() = %v, want ErrFenced", runErr)
	}
}

// TestPoolVouchesOnlyForCheckedWrites: a lane vouches, for its lease (Pool.Checked), that it
// writes checked only when it fenced every stream it writes; a pool judges (Pool.CanJudge) only
// an owner that vouched for every stream it writes and fences itself, and an Unfenced pool
// (the drill standing for a build before fencing) neither vouches nor judges. The fenced streams
// are read again while the pool runs (Config.RefreshFences): lanes started after the record of
// them was dropped fence nothing and vouch for nothing.
func TestPoolVouchesOnlyForCheckedWrites(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	both := []string{f.names.Outgoing, f.names.Unmapped}
	for _, s := range both {
		f.fenceStream(s)
	}
	want := wire.FormatChecked(both)
	vouches := func(pool *lanes.Pool, p int, fenced int) string {
		t.Helper()
		stop, _ := runLane(t, pool, lanes.Assignment{Partition: p, Epoch: 10, Owner: "r"})
		defer stop()
		natstest.Eventually(t, 10*time.Second, func() error {
			if len(pool.Partitions()) == 0 {
				return errors.New("the lane is not running yet")
			}
			return nil
		})
		if n := len(pool.Fences(p)); n != fenced {
			t.Errorf("partition %d: %d streams fenced, want %d", p, n, fenced)
		}
		if got := pool.Checked(p, 11); got != "" {
			t.Errorf("Checked(%d, another epoch) = %q, want nothing", p, got)
		}
		return pool.Checked(p, 10)
	}

	fenced := f.newPool(lanes.Config{Fences: both})
	if got := vouches(fenced, 1, 2); got != want {
		t.Errorf("a lane that fenced both outputs: Checked = %q, want %q", got, want)
	}
	if !fenced.CanJudge(want) || fenced.CanJudge(wire.FormatChecked([]string{f.names.Outgoing})) || fenced.CanJudge("") || fenced.CanJudge("v2 OUTGOING,UNMAPPED") {
		t.Errorf("CanJudge: want true for %q only", want)
	}
	if got := vouches(f.newPool(lanes.Config{Fences: both[:1]}), 2, 1); got != "" {
		t.Errorf("a lane that fenced OUTGOING only: Checked = %q, want nothing: it writes UNMAPPED unchecked", got)
	}
	unfenced := f.newPool(lanes.Config{Fences: both, Unfenced: true})
	if got := vouches(unfenced, 3, 0); got != "" || unfenced.CanJudge(want) {
		t.Errorf("Unfenced: Checked = %q, CanJudge = %v; want nothing, false", got, unfenced.CanJudge(want))
	}
	dropped := f.newPool(lanes.Config{Fences: both, RefreshFences: func(context.Context) ([]string, error) { return nil, nil }})
	if got := vouches(dropped, 4, 0); got != "" {
		t.Errorf("after the fenced streams' record was dropped: Checked = %q, want nothing", got)
	}
	// A takeover from an owner judged dead fences what that owner vouched for all the same.
	stop, _ := runLane(t, dropped, lanes.Assignment{Partition: 5, Epoch: 10, Owner: "r", Fence: both})
	defer stop()
	natstest.Eventually(t, 10*time.Second, func() error {
		if n := len(dropped.Fences(5)); n != 2 {
			return fmt.Errorf("a takeover told to fence %v fenced %d streams", both, n)
		}
		return nil
	})
}

// TestRecreatedOutgoingRefusesADeposedOwner: OUTGOING deleted and made again under a running
// lane starts its sequences from 1, and its next owner's fence record can land at the very
// sequence the deposed lane's checks expect (both the first message of their stream). The fence
// subject names the stream's incarnation, so the deposed lane's checks name a subject the new
// stream holds nothing on, and are refused; before, they passed, and it stored beside its
// successor.
func TestRecreatedOutgoingRefusesADeposedOwner(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	fenced := []string{f.names.Outgoing, f.names.Unmapped}
	for _, s := range fenced {
		f.fenceStream(s)
	}
	dev := "dev-x"
	p := subjects.Partition(dev, f.lay.Partitions)
	f.groups.set(dev, "g")
	deposed := f.newPool(lanes.Config{Fences: fenced})
	_, res := runLane(t, deposed, lanes.Assignment{Partition: p, Epoch: 10, Owner: "r10"})
	natstest.Eventually(t, 10*time.Second, func() error {
		if len(deposed.Fences(p)) != len(fenced) {
			return errors.New("the lane has not fenced its outputs yet")
		}
		return nil
	})
	old := deposed.Fences(p)[0]
	if old.Stream != f.names.Outgoing || old.Seq != 1 {
		t.Fatalf("the first lane's OUTGOING fence %+v, want the stream's first message: the test proves nothing", old)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := f.js.DeleteStream(ctx, f.names.Outgoing); err != nil {
		t.Fatal(err)
	}
	if _, err := setup.Ensure(ctx, f.js, f.setupConfig()); err != nil {
		t.Fatalf("setup.Ensure: %v", err)
	}
	f.fenceStream(f.names.Outgoing)
	successor := f.newPool(lanes.Config{Fences: fenced})
	fenceOnce(t, successor, p, 20, len(fenced))
	f.publish([]string{dev}, 3, nil)

	natstest.Eventually(t, 10*time.Second, func() error {
		select {
		case err := <-res:
			if !errors.Is(err, lanes.ErrFenced) {
				t.Errorf("the deposed lane's Run() = %v, want ErrFenced", err)
			}
			return nil
		default:
		}
		if f.count(f.names.Outgoing) > 1 {
			return nil // stored: checked below
		}
		return errors.New("the deposed lane neither stopped nor stored anything")
	})
	for _, m := range f.readFirst(f.names.Outgoing, f.count(f.names.Outgoing)) {
		if epochOf(m.Headers()) == "10" {
			t.Errorf("the re-created OUTGOING stored %q of the deposed epoch 10 after its successor's record", m.Data())
		}
	}
}
