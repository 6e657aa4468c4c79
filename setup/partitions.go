package setup

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// ErrNoMapping is wrapped by [Ensure]'s error in the [subjects.PartitionStreams] layout when the
// server does not put what devices publish into the partition streams: its account lacks the
// subject mapping, or has another one. The message holds the configuration to add
// ([MappingConfig]).
var ErrNoMapping = errors.New("setup: the server does not map device subjects into the partition streams")

// MappingConfig returns what a server needs to fill the partition streams of lay, for people to
// read: the `mappings` block of a server configuration file, and the nsc commands that add the
// same mapping to an account's JWT in operator mode.
func MappingConfig(lay *subjects.Layout) string {
	src, dest := lay.MappingSource(), lay.MappingDest()
	return fmt.Sprintf(`Add this to the configuration of every NATS server (inside the account's block, accounts { <ACCOUNT> { … } }, when the server has accounts), then reload it (nats-server --signal reload):

mappings {
  %q: %q
}

In operator mode (accounts in JWTs), add it to the account's JWT and push it:

  nsc add mapping --account <ACCOUNT> --from %q --to %q
  nsc push --account <ACCOUNT>
`, src, dest, src, dest)
}

// ServerMappings returns the account subject mappings (source → destination) c needs from the
// server: the partitioning mapping ([MappingConfig]) for the partition streams and for direct
// mode's default receive kind, none otherwise. A server kvmapper starts itself gets them before
// it accepts a connection.
func (c Config) ServerMappings() map[string]string {
	if c.Mode == wire.ModeDirect {
		if c.Receive != wire.ReceiveMapping {
			return nil
		}
	} else if c.StreamLayout != subjects.PartitionStreams {
		return nil
	}
	return map[string]string{c.Layout.MappingSource(): c.Layout.MappingDest()}
}

// ensurePartitionStreams creates or verifies the P partition streams, then probes that the
// server's account mapping puts each partition's messages into its stream.
func ensurePartitionStreams(ctx context.Context, js jetstream.JetStream, cfg Config) (string, error) {
	lay := cfg.Layout
	n := lay.Partitions
	if _, err := js.Stream(ctx, cfg.Incoming); err == nil {
		return "", fmt.Errorf("%w: stream %s of the single-stream layout exists and captures %s, which the partition streams %s overlap: map what it holds with --layout single first, then remove it (`nats stream rm %s`) and run kvmapper setup --layout streams; or keep --layout single",
			ErrMismatch, cfg.Incoming, lay.StreamSubject(), span(cfg.Names, n), cfg.Incoming)
	} else if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return "", fmt.Errorf("setup: looking up stream %s: %w", cfg.Incoming, err)
	}
	if _, err := js.Stream(ctx, cfg.PartitionStream(n)); err == nil {
		return "", fmt.Errorf("%w: stream %s exists: the partition streams were created for more than %d partitions; run with the partition count they were created for (--partitions), or remove every %s-<p> stream and run kvmapper setup again — the partition count is fixed once messages are stored",
			ErrMismatch, cfg.PartitionStream(n), n, cfg.Incoming)
	}
	created := 0
	for p := range n {
		name := cfg.PartitionStream(p)
		info, fresh, err := createOrGet(ctx, js, jetstream.StreamConfig{
			Name:        name,
			Description: fmt.Sprintf("kvmapper input: partition %d of %d, filled by the account mapping %s → %s", p, n, lay.MappingSource(), lay.MappingDest()),
			Subjects:    []string{lay.Filter(p)},
			Storage:     jetstream.FileStorage,
			Retention:   jetstream.LimitsPolicy,
			Replicas:    cfg.Replicas,
		})
		if err != nil {
			return "", err
		}
		if fresh {
			created++
			continue
		}
		got := info.Config
		if !slices.Contains(got.Subjects, lay.Filter(p)) {
			return "", fmt.Errorf("%w: stream %s captures %v, not %q: fix its subjects with `nats stream edit %s --subjects %q`, or pass the --in template it was built for",
				ErrMismatch, name, got.Subjects, lay.Filter(p), name, lay.Filter(p))
		}
		if got.SubjectTransform != nil {
			return "", fmt.Errorf("%w: stream %s has the subject transform %q → %q; a partition stream stores what the account mapping delivers unchanged: recreate it (`nats stream rm %s`, then kvmapper setup)",
				ErrMismatch, name, got.SubjectTransform.Source, got.SubjectTransform.Destination, name)
		}
	}
	if err := CheckMapping(ctx, js, cfg); err != nil {
		return "", err
	}
	what := fmt.Sprintf("partition streams %s ok", span(cfg.Names, n))
	if created > 0 {
		what = fmt.Sprintf("created %d of the partition streams %s", created, span(cfg.Names, n))
	}
	return fmt.Sprintf("%s: %s filled by the account mapping %s → %s (a probe reached every partition's stream)",
		what, lay.In.Prefix()+".<p>.>", lay.MappingSource(), lay.MappingDest()), nil
}

// span names the partition streams for people: "INCOMING-0 … INCOMING-15".
func span(n subjects.Names, partitions int) string {
	if partitions == 1 {
		return n.PartitionStream(0)
	}
	return n.PartitionStream(0) + " … " + n.PartitionStream(partitions-1)
}

// probeExpect is the Nats-Expected-Stream of a probe: not a valid stream name, so no stream can
// match it, and every stream that captures a probe refuses it without storing it.
const probeExpect = "kvmapper.probe"

// CheckMapping checks that the server puts what devices publish into the partition streams of
// cfg, which must exist: it publishes one probe per partition, on a device of that partition,
// and checks that the partition's stream is the one that captures it. It returns an error
// wrapping [ErrNoMapping], with the configuration to add, when one is not. [Ensure] calls it in
// the partition-streams layout; it blocks for one round trip per partition.
//
// A probe carries Nats-Expected-Stream naming no stream: the capturing stream refuses it and
// answers with its own name, so nothing is stored, nothing reaches a lane or OUTGOING, and
// there is nothing to delete afterwards (core subscribers of the device subjects do see the
// probes). No answer at all means that no stream captured it: the mapping is missing.
func CheckMapping(ctx context.Context, js jetstream.JetStream, cfg Config) error {
	cfg.Defaults()
	if cfg.Layout == nil {
		return fmt.Errorf("%w: Layout is required", ErrInvalidConfig)
	}
	lay := cfg.Layout
	nc := js.Conn()
	devices := probeDevices(lay.Partitions)
	var nowhere, elsewhere []string
	for p, dev := range devices {
		subject, err := probeSubject(lay, dev)
		if err != nil {
			return err
		}
		want := cfg.PartitionStream(p)
		got, err := probe(ctx, js, nc, subject, want)
		if err != nil {
			return err
		}
		switch got {
		case want:
		case "":
			nowhere = append(nowhere, fmt.Sprintf("%s (for %s)", subject, want))
		default:
			elsewhere = append(elsewhere, fmt.Sprintf("%s reached %s, not %s", subject, got, want))
		}
	}
	if len(nowhere) == 0 && len(elsewhere) == 0 {
		return nil
	}
	var why string
	switch {
	case len(nowhere) == lay.Partitions:
		why = fmt.Sprintf("no stream captured the probes published to %s (e.g. %s): the account has no mapping %s → %s",
			lay.StreamSubject(), nowhere[0], lay.MappingSource(), lay.MappingDest())
	case len(elsewhere) > 0:
		why = fmt.Sprintf("%d of %d probes reached the wrong stream (e.g. %s): the account maps %s with another partition count or template",
			len(elsewhere), lay.Partitions, elsewhere[0], lay.MappingSource())
	default:
		why = fmt.Sprintf("%d of %d probes reached no stream (e.g. %s): the account maps %s with another partition count or template",
			len(nowhere), lay.Partitions, nowhere[0], lay.MappingSource())
	}
	return fmt.Errorf("%w: %s.\n\n%s\nOr run with --layout single, which partitions with a stream subject transform and needs no mapping",
		ErrNoMapping, why, MappingConfig(lay))
}

// probeDevices returns, for each partition, a device token of that partition.
func probeDevices(partitions int) []string {
	out := make([]string, partitions)
	left := partitions
	for i := 0; left > 0; i++ {
		d := wire.ProbeDevicePrefix + strconv.Itoa(i)
		if p := subjects.Partition(d, partitions); out[p] == "" {
			out[p] = d
			left--
		}
	}
	return out
}

// probeSubject renders the in template with device dev and "probe" for every other placeholder.
func probeSubject(lay *subjects.Layout, dev string) (string, error) {
	values := map[string]string{}
	for _, name := range lay.In.Placeholders() {
		values[name] = "probe"
	}
	values["device"] = dev
	s, err := lay.In.Render(values)
	if err != nil {
		return "", fmt.Errorf("setup: rendering a probe subject: %w", err)
	}
	return s, nil
}

// probeTimeout bounds the wait for one probe's answer, and probeWait the wait for a new stream's
// leader on a cluster.
const (
	probeTimeout = 5 * time.Second
	probeWait    = 10 * time.Second
)

// probe publishes one probe on subject and returns the name of the stream that captured it, or
// "" when none did. A partition stream without a leader yet (just created on a cluster) captures
// nothing: probe waits for its leader.
func probe(ctx context.Context, js jetstream.JetStream, nc *nats.Conn, subject, want string) (string, error) {
	deadline := time.Now().Add(probeWait)
	for {
		m := nats.NewMsg(subject)
		m.Header.Set(jetstream.ExpectedStreamHeader, probeExpect)
		rctx, cancel := context.WithTimeout(ctx, probeTimeout)
		resp, err := nc.RequestMsgWithContext(rctx, m)
		cancel()
		if errors.Is(err, nats.ErrNoResponders) {
			if time.Now().Before(deadline) && leaderless(ctx, js, want) {
				t := time.NewTimer(100 * time.Millisecond)
				select {
				case <-t.C:
					continue
				case <-ctx.Done():
					t.Stop()
					return "", ctx.Err()
				}
			}
			return "", nil
		}
		if err != nil {
			return "", fmt.Errorf("setup: probing the account mapping on %s: %w (kvmapper setup publishes one message per partition to the device subjects, which the streams refuse and do not store: the user needs permission to publish there)", subject, err)
		}
		var r struct {
			Stream string `json:"stream"`
			Error  *struct {
				Code        int    `json:"code"`
				Description string `json:"description"`
			} `json:"error"`
		}
		if err := json.Unmarshal(resp.Data, &r); err != nil || r.Stream == "" {
			return "", fmt.Errorf("setup: probing the account mapping on %s: unexpected answer %q", subject, resp.Data)
		}
		if r.Error == nil {
			// Only a stream named like the probe's expectation would store it, and no stream can be.
			return "", fmt.Errorf("setup: probing the account mapping on %s: stream %s stored the probe (%s)", subject, r.Stream, strings.TrimSpace(string(resp.Data)))
		}
		return r.Stream, nil
	}
}

// leaderless reports whether stream exists on a cluster and has no leader yet.
func leaderless(ctx context.Context, js jetstream.JetStream, stream string) bool {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return false
	}
	ci := s.CachedInfo().Cluster
	return ci != nil && ci.Leader == ""
}
