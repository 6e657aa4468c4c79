package setup_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func layout(t *testing.T, partitions int) *subjects.Layout {
	t.Helper()
	lay, err := subjects.NewLayout("incoming.{device}.{event}", "outgoing.{group}.{device}.{event}", "unmapped.{device}.{event}", partitions)
	if err != nil {
		t.Fatal(err)
	}
	return lay
}

func TestEnsureCreatesThenVerifies(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	ctx := context.Background()
	cfg := setup.Config{Layout: layout(t, 16)}

	first, err := setup.Ensure(ctx, js, cfg)
	if err != nil {
		t.Fatalf("Ensure: %v", err)
	}
	second, err := setup.Ensure(ctx, js, cfg)
	if err != nil {
		t.Fatalf("second Ensure: %v", err)
	}
	if len(first) != 6 || len(second) != 6 {
		t.Fatalf("Ensure reported %d then %d lines, want 6 each (five streams and buckets, the layout):\n%s\n%s", len(first), len(second), first, second)
	}
	if want := "recorded layout single in bucket kvmapper"; !strings.HasPrefix(first[5], want) {
		t.Errorf("first run's last line %q, want %q…", first[5], want)
	}
	if want := "layout single, as recorded in bucket kvmapper"; !strings.HasPrefix(second[5], want) {
		t.Errorf("second run's last line %q, want %q…", second[5], want)
	}
	first, second = first[:5], second[:5]
	for i := range first {
		if !strings.HasPrefix(first[i], "created ") {
			t.Errorf("first run line %d = %q, want created …", i, first[i])
		}
		if !strings.Contains(second[i], " ok") || strings.Contains(second[i], "created") {
			t.Errorf("second run line %d = %q, want … ok", i, second[i])
		}
	}

	s, err := js.Stream(ctx, "INCOMING")
	if err != nil {
		t.Fatal(err)
	}
	tr := s.CachedInfo().Config.SubjectTransform
	if tr == nil || tr.Source != "incoming.*.*" || tr.Destination != "incoming.{{partition(16,1)}}.{{wildcard(1)}}.{{wildcard(2)}}" {
		t.Errorf("INCOMING transform = %+v", tr)
	}
	for _, name := range []string{"OUTGOING", "UNMAPPED"} {
		s, err := js.Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if d := s.CachedInfo().Config.Duplicates; d < setup.MinDuplicateWindow {
			t.Errorf("%s duplicate window %v, want at least %v", name, d, setup.MinDuplicateWindow)
		}
	}
	ctl, err := js.KeyValue(ctx, "kvmapper")
	if err != nil {
		t.Fatal(err)
	}
	st, err := ctl.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.LimitMarkerTTL() == 0 {
		t.Error("control bucket created without LimitMarkerTTL")
	}
}

// The server stamps partitions on ingest: what Ensure creates must put a device where
// subjects.Partition says.
func TestIncomingPartitionsLikeSubjects(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	ctx := context.Background()
	lay := layout(t, 16)
	if _, err := setup.Ensure(ctx, js, setup.Config{Layout: lay}); err != nil {
		t.Fatal(err)
	}
	s, err := js.Stream(ctx, "INCOMING")
	if err != nil {
		t.Fatal(err)
	}
	for _, dev := range []string{"dev-42", "a", "sensor-0001", "héllo"} {
		ack, err := js.Publish(ctx, "incoming."+dev+".temp", []byte("x"))
		if err != nil {
			t.Fatal(err)
		}
		msg, err := s.GetMsg(ctx, ack.Sequence)
		if err != nil {
			t.Fatal(err)
		}
		want, _ := lay.StoredSubject(map[string]string{"device": dev, "event": "temp"})
		if msg.Subject != want {
			t.Errorf("stored subject %q, want %q", msg.Subject, want)
		}
	}
}

func TestEnsureRefusesMismatches(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, tc := range map[string]struct {
		prepare func(t *testing.T, js jetstream.JetStream)
		cfg     func(t *testing.T) setup.Config
		want    []string
	}{
		"partition count": {
			prepare: func(t *testing.T, js jetstream.JetStream) {
				if _, err := setup.Ensure(ctx, js, setup.Config{Layout: layout(t, 8)}); err != nil {
					t.Fatal(err)
				}
			},
			cfg:  func(t *testing.T) setup.Config { return setup.Config{Layout: layout(t, 16)} },
			want: []string{"8 partitions", "--partitions 8", "nats stream rm INCOMING"},
		},
		"incoming without transform": {
			prepare: func(t *testing.T, js jetstream.JetStream) {
				if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "INCOMING", Subjects: []string{"incoming.*.*"}}); err != nil {
					t.Fatal(err)
				}
			},
			cfg:  func(t *testing.T) setup.Config { return setup.Config{Layout: layout(t, 16)} },
			want: []string{"no subject transform", "nats stream rm INCOMING"},
		},
		"control bucket without limit markers": {
			prepare: func(t *testing.T, js jetstream.JetStream) {
				if _, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "kvmapper"}); err != nil {
					t.Fatal(err)
				}
			},
			cfg:  func(t *testing.T) setup.Config { return setup.Config{Layout: layout(t, 16)} },
			want: []string{"LimitMarkerTTL", "nats kv rm kvmapper", "--control-bucket"},
		},
		"short duplicate window": {
			prepare: func(t *testing.T, js jetstream.JetStream) {
				if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "OUTGOING", Subjects: []string{"outgoing.>"}, Duplicates: 10 * time.Second}); err != nil {
					t.Fatal(err)
				}
			},
			cfg:  func(t *testing.T) setup.Config { return setup.Config{Layout: layout(t, 16)} },
			want: []string{"duplicate window of 10s", "--dupe-window 2m0s"},
		},
		"outgoing on other subjects": {
			prepare: func(t *testing.T, js jetstream.JetStream) {
				if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "OUTGOING", Subjects: []string{"elsewhere.>"}, Duplicates: 5 * time.Minute}); err != nil {
					t.Fatal(err)
				}
			},
			cfg:  func(t *testing.T) setup.Config { return setup.Config{Layout: layout(t, 16)} },
			want: []string{`not "outgoing.>"`, "nats stream edit OUTGOING"},
		},
	} {
		t.Run(name, func(t *testing.T) {
			srv := natstest.Start(t)
			_, js := srv.JetStream(t)
			tc.prepare(t, js)
			_, err := setup.Ensure(ctx, js, tc.cfg(t))
			if !errors.Is(err, setup.ErrMismatch) {
				t.Fatalf("Ensure() error = %v, want ErrMismatch", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
		})
	}
}

func TestEnsureInvalidConfig(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t)
	_, js := srv.JetStream(t)
	for name, cfg := range map[string]setup.Config{
		"no layout":              {},
		"short duplicate window": {Layout: layout(t, 16), DuplicateWindow: time.Minute},
	} {
		if _, err := setup.Ensure(context.Background(), js, cfg); !errors.Is(err, setup.ErrInvalidConfig) {
			t.Errorf("%s: Ensure() error = %v, want ErrInvalidConfig", name, err)
		}
	}
}

// --groups-history sets the history of a groups bucket setup creates, and an existing bucket
// that keeps fewer values is an error only when it was asked for.
func TestGroupsHistory(t *testing.T) {
	t.Parallel()
	_, js := natstest.Start(t).JetStream(t)
	ctx := context.Background()
	history := func(bucket string) int64 {
		t.Helper()
		kv, err := js.KeyValue(ctx, bucket)
		if err != nil {
			t.Fatal(err)
		}
		st, err := kv.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return st.History()
	}
	if _, err := setup.Ensure(ctx, js, setup.Config{Layout: layout(t, 16), GroupsHistory: 64}); err != nil {
		t.Fatalf("Ensure(GroupsHistory 64): %v", err)
	}
	if h := history("device-groups"); h != 64 {
		t.Errorf("created groups bucket keeps %d values per key, want 64", h)
	}
	names := subjects.Names{Groups: "short"}
	if _, err := setup.Ensure(ctx, js, setup.Config{Layout: layout(t, 16), Names: names}); err != nil {
		t.Fatalf("Ensure: %v", err)
	}
	if h := history("short"); h != setup.DefaultGroupsHistory {
		t.Errorf("groups bucket created by default keeps %d values per key, want %d", h, setup.DefaultGroupsHistory)
	}
	_, err := setup.Ensure(ctx, js, setup.Config{Layout: layout(t, 16), Names: names, GroupsHistory: 10})
	if !errors.Is(err, setup.ErrMismatch) || !strings.Contains(err.Error(), "nats kv edit short --history 10") {
		t.Errorf("Ensure(GroupsHistory 10) on a bucket keeping 5 = %v, want ErrMismatch naming `nats kv edit short --history 10`", err)
	}
	if _, err := setup.Ensure(ctx, js, setup.Config{Layout: layout(t, 16), Names: names, GroupsHistory: 5}); err != nil {
		t.Errorf("Ensure(GroupsHistory 5) on a bucket keeping 5: %v", err)
	}
	if _, err := setup.Ensure(ctx, js, setup.Config{Layout: layout(t, 16), GroupsHistory: 65}); !errors.Is(err, setup.ErrInvalidConfig) {
		t.Errorf("Ensure(GroupsHistory 65) = %v, want ErrInvalidConfig", err)
	}
}
