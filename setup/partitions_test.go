package setup_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/natstest"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
)

// streamsConfig is the streams layout with the default names.
func streamsConfig(t *testing.T, partitions int) setup.Config {
	return setup.Config{Layout: layout(t, partitions), Names: subjects.Names{StreamLayout: subjects.PartitionStreams}}
}

// mapped starts a server whose global account maps the device subjects of lay into partitions,
// as the mappings block of setup.MappingConfig does.
func mapped(t *testing.T, lay *subjects.Layout) *natstest.Server {
	t.Helper()
	srv := natstest.Start(t)
	if err := srv.GlobalAccount().AddMapping(lay.MappingSource(), lay.MappingDest()); err != nil {
		t.Fatalf("AddMapping: %v", err)
	}
	return srv
}

func TestPartitionStreamsCreatedThenVerified(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg := streamsConfig(t, 16)
	_, js := mapped(t, cfg.Layout).JetStream(t)
	first, err := setup.Ensure(ctx, js, cfg)
	if err != nil {
		t.Fatalf("Ensure: %v", err)
	}
	second, err := setup.Ensure(ctx, js, cfg)
	if err != nil {
		t.Fatalf("second Ensure: %v", err)
	}
	if len(first) != 6 || len(second) != 6 {
		t.Fatalf("Ensure reported %d then %d lines, want 6 each:\n%s\n%s", len(first), len(second), first, second)
	}
	if want := "recorded layout streams in bucket kvmapper"; !strings.HasPrefix(first[5], want) {
		t.Errorf("first run's last line %q, want %q…", first[5], want)
	}
	if want := "created 16 of the partition streams INCOMING-0 … INCOMING-15"; !strings.HasPrefix(first[0], want) {
		t.Errorf("first line %q, want %q…", first[0], want)
	}
	if want := "partition streams INCOMING-0 … INCOMING-15 ok"; !strings.HasPrefix(second[0], want) {
		t.Errorf("second run's first line %q, want %q…", second[0], want)
	}
	for p := range 16 {
		s, err := js.Stream(ctx, fmt.Sprintf("INCOMING-%d", p))
		if err != nil {
			t.Fatal(err)
		}
		info := s.CachedInfo()
		if got := info.Config.Subjects; len(got) != 1 || got[0] != fmt.Sprintf("incoming.%d.>", p) || info.Config.SubjectTransform != nil {
			t.Errorf("INCOMING-%d captures %v with transform %v, want incoming.%d.> alone", p, got, info.Config.SubjectTransform, p)
		}
		// The probes were refused, not stored: nothing for a lane to map.
		if info.State.Msgs != 0 || info.State.LastSeq != 0 {
			t.Errorf("INCOMING-%d holds %d messages up to sequence %d after setup, want none ever stored", p, info.State.Msgs, info.State.LastSeq)
		}
	}
	if _, err := js.Stream(ctx, "INCOMING"); !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Errorf("Stream(INCOMING) = %v, want not found in the streams layout", err)
	}
}

// The account mapping must put a device where subjects.Partition says, in the stream of that
// partition, under the subject the single layout stores.
func TestPartitionStreamsPartitionLikeSubjects(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg := streamsConfig(t, 16)
	_, js := mapped(t, cfg.Layout).JetStream(t)
	if _, err := setup.Ensure(ctx, js, cfg); err != nil {
		t.Fatal(err)
	}
	for _, dev := range []string{"dev-42", "a", "sensor-0001", "héllo"} {
		ack, err := js.Publish(ctx, "incoming."+dev+".temp", []byte("x"))
		if err != nil {
			t.Fatal(err)
		}
		p := subjects.Partition(dev, 16)
		if want := fmt.Sprintf("INCOMING-%d", p); ack.Stream != want {
			t.Errorf("device %s stored in %s, want %s", dev, ack.Stream, want)
			continue
		}
		s, err := js.Stream(ctx, ack.Stream)
		if err != nil {
			t.Fatal(err)
		}
		msg, err := s.GetMsg(ctx, ack.Sequence)
		if err != nil {
			t.Fatal(err)
		}
		want, _ := cfg.Layout.StoredSubject(map[string]string{"device": dev, "event": "temp"})
		if msg.Subject != want {
			t.Errorf("stored subject %q, want %q", msg.Subject, want)
		}
	}
}

// Without the mapping, setup refuses and says what to add; the block it prints, put into a
// server's configuration file, is what the server needs.
func TestPartitionStreamsRefusedWithoutTheMapping(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg := streamsConfig(t, 16)
	_, js := natstest.Start(t).JetStream(t)
	_, err := setup.Ensure(ctx, js, cfg)
	if !errors.Is(err, setup.ErrNoMapping) {
		t.Fatalf("Ensure() error = %v, want ErrNoMapping", err)
	}
	block := `mappings {
  "incoming.*.*": "incoming.{{partition(16,1)}}.{{wildcard(1)}}.{{wildcard(2)}}"
}`
	for _, want := range []string{block, setup.MappingConfig(cfg.Layout), "no stream captured the probes",
		`nsc add mapping --account <ACCOUNT> --from "incoming.*.*" --to "incoming.{{partition(16,1)}}.{{wildcard(1)}}.{{wildcard(2)}}"`,
		"--layout single"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not say %q:\n%v", want, err)
		}
	}

	conf := filepath.Join(t.TempDir(), "nats.conf")
	text := fmt.Sprintf("host: 127.0.0.1\nport: -1\njetstream { store_dir: %q }\n%s\n", t.TempDir(), block)
	if err := os.WriteFile(conf, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	opts, err := server.ProcessConfigFile(conf)
	if err != nil {
		t.Fatalf("the printed block does not parse as server configuration: %v", err)
	}
	opts.NoLog, opts.NoSigs = true, true
	_, js = natstest.StartWith(t, opts).JetStream(t)
	if _, err := setup.Ensure(ctx, js, cfg); err != nil {
		t.Fatalf("Ensure on a server configured with the printed block: %v", err)
	}
}

func TestPartitionStreamsRefuseMismatches(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, tc := range map[string]struct {
		mapping *subjects.Layout // the server's mapping; nil for none
		prepare func(t *testing.T, js jetstream.JetStream)
		cfg     setup.Config
		is      error
		want    []string
	}{
		"mapping for another partition count": {
			mapping: layout(t, 8),
			cfg:     streamsConfig(t, 16),
			is:      setup.ErrNoMapping,
			want:    []string{"another partition count", "partition(16,1)"},
		},
		// A deployment made before setup recorded layouts: the streams themselves refuse.
		"single-layout INCOMING present": {
			mapping: layout(t, 16),
			prepare: func(t *testing.T, js jetstream.JetStream) {
				if _, err := setup.Ensure(ctx, js, setup.Config{Layout: layout(t, 16)}); err != nil {
					t.Fatal(err)
				}
				forgetLayout(t, js)
			},
			cfg:  streamsConfig(t, 16),
			is:   setup.ErrMismatch,
			want: []string{"single-stream layout", "nats stream rm INCOMING", "--layout single"},
		},
		"partition streams of a larger count": {
			mapping: layout(t, 16),
			prepare: func(t *testing.T, js jetstream.JetStream) {
				if _, err := setup.Ensure(ctx, js, streamsConfig(t, 16)); err != nil {
					t.Fatal(err)
				}
			},
			cfg:  streamsConfig(t, 8),
			is:   setup.ErrMismatch,
			want: []string{"INCOMING-8 exists", "more than 8 partitions"},
		},
		"single layout over partition streams": {
			mapping: layout(t, 16),
			prepare: func(t *testing.T, js jetstream.JetStream) {
				if _, err := setup.Ensure(ctx, js, streamsConfig(t, 16)); err != nil {
					t.Fatal(err)
				}
				forgetLayout(t, js)
			},
			cfg:  setup.Config{Layout: layout(t, 16)},
			is:   setup.ErrMismatch,
			want: []string{"partition streams of the streams layout", "--layout streams"},
		},
	} {
		t.Run(name, func(t *testing.T) {
			srv := natstest.Start(t)
			if tc.mapping != nil {
				if err := srv.GlobalAccount().AddMapping(tc.mapping.MappingSource(), tc.mapping.MappingDest()); err != nil {
					t.Fatal(err)
				}
			}
			_, js := srv.JetStream(t)
			if tc.prepare != nil {
				tc.prepare(t, js)
			}
			_, err := setup.Ensure(ctx, js, tc.cfg)
			if !errors.Is(err, tc.is) {
				t.Fatalf("Ensure() error = %v, want %v", err, tc.is)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
		})
	}
}
