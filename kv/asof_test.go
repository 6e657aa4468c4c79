package kv_test

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/kv"
)

func asOf(t *testing.T, js jetstream.JetStream, rev uint64) *kv.Snapshot {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	s, err := kv.AsOf(ctx, js, "device-groups", rev, nil)
	if err != nil {
		t.Fatalf("AsOf(%d): %v", rev, err)
	}
	return s
}

func wantEntry(t *testing.T, s *kv.Snapshot, device string, want kv.Entry) {
	t.Helper()
	if got, ok := s.Lookup(device); !ok || !sameEntry(got, want) {
		t.Errorf("as of %d: Lookup(%s) = %+v, %v; want %+v, true", s.Revision, device, got, ok, want)
	}
}

func wantAbsent(t *testing.T, s *kv.Snapshot, device string) {
	t.Helper()
	if got, ok := s.Lookup(device); ok {
		t.Errorf("as of %d: Lookup(%s) = %+v, true; want absent", s.Revision, device, got)
	}
}

// Every revision of a bucket whose history is complete gives the table a watch had then.
func TestAsOfRevisions(t *testing.T) {
	_, js := natstest.Start(t).JetStream(t)
	ctx := context.Background()
	b, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "device-groups", History: 10})
	if err != nil {
		t.Fatal(err)
	}
	put(t, b, "a", "g1")                       // 1
	put(t, b, "b", "g2")                       // 2
	put(t, b, "a", "g3\n")                     // 3: the newline `nats kv put` leaves is trimmed, as Table does
	if err := b.Delete(ctx, "b"); err != nil { // 4
		t.Fatal(err)
	}
	put(t, b, "c", "not.one") // 5: invalid

	if s := asOf(t, js, 0); s.Len() != 0 || s.Lost != 0 {
		t.Errorf("as of 0: %d devices, lost %d; want an empty, exact table", s.Len(), s.Lost)
	}
	s := asOf(t, js, 2)
	wantEntry(t, s, "a", kv.Entry{Group: "g1", Revision: 1})
	wantEntry(t, s, "b", kv.Entry{Group: "g2", Revision: 2})
	wantAbsent(t, s, "c")
	if s.Lost != 0 || len(s.UnknownKeys()) != 0 || s.Last != 5 {
		t.Errorf("as of 2: lost %d, unknown %v, last %d; want 0, none, 5", s.Lost, s.UnknownKeys(), s.Last)
	}
	s = asOf(t, js, 4)
	wantEntry(t, s, "a", kv.Entry{Group: "g3", Revision: 3})
	wantAbsent(t, s, "b")
	s = asOf(t, js, 5)
	wantEntry(t, s, "c", kv.Entry{Revision: 5, Invalid: true})
	if s.Len() != 2 {
		t.Errorf("as of 5: %d devices, want 2", s.Len())
	}
	_, err = kv.AsOf(ctx, js, "device-groups", 6, nil)
	if !errors.Is(err, kv.ErrFutureRevision) {
		t.Errorf("AsOf(6) = %v, want ErrFutureRevision", err)
	}
	_, err = kv.AsOf(ctx, js, "nope", 1, nil)
	if !errors.Is(err, jetstream.ErrBucketNotFound) {
		t.Errorf("AsOf on a missing bucket = %v, want ErrBucketNotFound", err)
	}
}

// A key whose value at the revision the bucket no longer holds is named, and only such keys.
func TestAsOfNamesKeysWhoseValueIsGone(t *testing.T) {
	_, js := natstest.Start(t).JetStream(t)
	ctx := context.Background()
	b, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "device-groups", History: 2})
	if err != nil {
		t.Fatal(err)
	}
	put(t, b, "moved", "g1")                       // 1: dropped by the two writes below
	put(t, b, "steady", "g1")                      // 2
	put(t, b, "moved", "g2")                       // 3
	put(t, b, "moved", "g3")                       // 4
	put(t, b, "new", "g1")                         // 5: created after revision 2, one write: not unknown
	put(t, b, "purged", "g1")                      // 6
	if err := b.Purge(ctx, "purged"); err != nil { // 7: removes 6
		t.Fatal(err)
	}

	s := asOf(t, js, 2)
	if got, want := s.UnknownKeys(), []string{"moved", "purged"}; !slices.Equal(got, want) {
		t.Errorf("as of 2: unknown %v, want %v", got, want)
	}
	if !s.Unknown("moved") || s.Unknown("steady") || s.Unknown("new") {
		t.Errorf("as of 2: Unknown(moved, steady, new) = %v %v %v, want true false false",
			s.Unknown("moved"), s.Unknown("steady"), s.Unknown("new"))
	}
	wantAbsent(t, s, "moved")
	wantEntry(t, s, "steady", kv.Entry{Group: "g1", Revision: 2})
	wantAbsent(t, s, "new")
	if s.Lost != 1 || s.History != 2 {
		t.Errorf("as of 2: lost %d, history %d; want 1, 2", s.Lost, s.History)
	}
	// From revision 3 on, moved's value is held.
	s = asOf(t, js, 3)
	wantEntry(t, s, "moved", kv.Entry{Group: "g2", Revision: 3})
	if got := s.UnknownKeys(); !slices.Equal(got, []string{"purged"}) {
		t.Errorf("as of 3: unknown %v, want [purged]", got)
	}
	// The purge marker itself says the key is gone at 7.
	s = asOf(t, js, 7)
	wantAbsent(t, s, "purged")
	if len(s.UnknownKeys()) != 0 {
		t.Errorf("as of 7: unknown %v, want none", s.UnknownKeys())
	}
}
