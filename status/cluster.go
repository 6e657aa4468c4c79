package status

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/ordered"
	"github.com/kvmapper/kvmapper/subjects"
)

// Replication is how one stream (or a bucket's stream) is held by the servers: its leader and
// each follower's state, as the stream's info gives them. On a single server it has one replica
// and no followers.
type Replication struct {
	// Stream is the stream's name; for a bucket, KV_<bucket>.
	Stream string `json:"stream"`
	// Replicas is the replica count the stream was created with.
	Replicas int `json:"replicas"`
	// Leader is the server that leads the stream; "" when none does (it is electing one, or
	// did not answer: see Error).
	Leader string `json:"leader"`
	// Followers are the other replicas.
	Followers []Follower `json:"followers,omitempty"`
	// WriteMode is how kvmapper's lanes write it, for an output stream (OUTGOING, UNMAPPED,
	// PARKED): "atomic", "batch" or "single" (ordered.ModeFor); "" for the others.
	WriteMode string `json:"write_mode,omitempty"`
	// Error says why the stream's info could not be read (a stream electing its leader answers
	// nothing for seconds).
	Error string `json:"error,omitempty"`

	mode string // how it would be written, were it an output stream
}

// Follower is one replica of a stream that does not lead it.
type Follower struct {
	Name string `json:"name"`
	// Current is true when it has everything the leader has.
	Current bool `json:"current"`
	// Offline is true when the leader has not heard from it lately.
	Offline bool `json:"offline,omitempty"`
	// Lag is how many operations it is behind the leader.
	Lag uint64 `json:"lag"`
	// SeenAgo is how long ago the leader last heard from it.
	SeenAgo time.Duration `json:"seen_ago_ns"`
}

// Healthy reports whether the stream has a leader and every follower is current.
func (r Replication) Healthy() bool {
	if r.Leader == "" && r.Replicas > 1 || r.Error != "" {
		return false
	}
	for _, f := range r.Followers {
		if !f.Current || f.Offline {
			return false
		}
	}
	return true
}

// StreamNames returns every stream kvmapper uses under names: INCOMING (or each partition
// stream), OUTGOING, UNMAPPED and the streams of the groups and control buckets.
func StreamNames(names subjects.Names, partitions int) []string {
	names = names.WithDefaults()
	out := names.IncomingStreams(partitions)
	return append(out, names.Outgoing, names.Unmapped, subjects.BucketStream(names.Groups), subjects.BucketStream(names.Control))
}

// ReadReplication reads the replication of each stream, all at once, each within timeout. A
// stream whose info does not come is listed with Error set: it never fails as a whole.
func ReadReplication(ctx context.Context, js jetstream.JetStream, streams []string, timeout time.Duration) []Replication {
	out := make([]Replication, len(streams))
	var wg sync.WaitGroup
	for i, name := range streams {
		wg.Go(func() {
			rctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			out[i] = readReplication(rctx, js, name)
		})
	}
	wg.Wait()
	return out
}

func readReplication(ctx context.Context, js jetstream.JetStream, name string) Replication {
	r := Replication{Stream: name}
	s, err := js.Stream(ctx, name)
	if err != nil {
		r.Error = fmt.Sprintf("no stream info (%v): a replicated stream electing its leader answers nothing for seconds", err)
		return r
	}
	info := s.CachedInfo()
	r.Replicas = info.Config.Replicas
	r.mode = ordered.ModeFor(info.Config).String()
	if info.Cluster == nil {
		return r
	}
	r.Leader = info.Cluster.Leader
	for _, p := range info.Cluster.Replicas {
		if p == nil {
			continue
		}
		r.Followers = append(r.Followers, Follower{Name: p.Name, Current: p.Current, Offline: p.Offline, Lag: p.Lag, SeenAgo: p.Active})
	}
	return r
}
