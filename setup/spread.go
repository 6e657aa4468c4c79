package setup

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Spreading the partition streams' leaders over a cluster's servers.
//
// JetStream elects each replicated stream's Raft leader on its own and balances nothing across
// streams: measured on an in-process 3-node cluster, the 16 partition streams setup creates at
// R3 got anything from 6/9/1 to 4/6/6 leaders per server in 12 runs, never 5 or 6 each (docs/cluster.md,
// Where the partition streams' leaders go). A stream's leader stores its messages and serves its
// consumers, so the server that leads most partitions does most of the ingest and reading while
// the others idle. With BalanceLeaders, [Ensure] moves leaderships from the servers that lead the
// most to those that lead the fewest until no two servers differ by more than one, as far as
// each stream's replicas allow.
//
// Only the partition streams are moved:
//   - they are the P equal shares of the work, the thing that spreads; OUTGOING, UNMAPPED and the
//     buckets are one stream each and cannot be divided by moving them;
//   - a partition stream's step-down reorders nothing (integration
//     TestClusterRidesThroughNodeLossPartitionStreams steps one down, and has setup spread them,
//     under load), while a step-down of OUTGOING or UNMAPPED can reverse the order of a device's
//     messages in flight from a lane (docs/cluster.md, Limits on a cluster), and one of the control bucket
//     pauses every lease renewal and checkpoint for the handover. Setup may run beside live
//     replicas, so it touches only what is safe to touch under load.

// Spreading is bounded, and each request within it. Under load (a 3-node cluster in one process
// on 2 cores, under the race detector, mapping 500 msgs/s) one read of 16 streams' info took
// 1.9 s and a move 0.1–1.2 s.
const (
	spreadTimeout        = 15 * time.Second
	spreadRequestTimeout = 2 * time.Second
)

// liveWindow is how recently a stream's leader must have heard from a replica for setup to count
// it and to hand it a leadership. A server that has just died is neither offline (its peers
// mark it so after 150 s or more) nor behind (for 10 s) in the stream's info; only the time since
// the leader last heard from it tells, and followers answer the leader's heartbeat every second.
// nats-server itself hands a leadership to a peer heard from within 3 s (raft.go,
// withinLiveWindow): a leadership handed to a server dead for less than liveWindow is lost until
// the stream elects its next leader (4–9 s), as if its leader had died.
const liveWindow = 2 * time.Second

// settleTimeout bounds how long setup waits, when no move is left, for replicas it could not
// count to become current: a stream just created, or just handed over, whose leader has not
// yet heard from every follower, or a server that has just died, which a stream's new leader
// lists as neither offline nor silent, having never heard from it at all.
const settleTimeout = 3 * time.Second

// leadership is who leads one partition stream and who could.
type leadership struct {
	stream string
	leader string // the server that leads it
	// peers are the other replicas the leadership may move to: online, current with the
	// leader and heard from within liveWindow. Setup counts a server only when it leads a
	// stream or is a peer of one.
	peers []string
	// unsure is set when a replica is listed that is neither offline nor a peer: behind the
	// leader, or not heard from.
	unsure bool
}

// errNoLeader is why a stream's leadership cannot be read: it is electing its leader.
var errNoLeader = errors.New("no leader yet")

// spreadLeaders moves the leaderships of the partition streams of cfg so that every server
// holding their replicas leads P/N or P/N+1 of them (as close as single moves allow when the
// streams have fewer replicas than the cluster has servers), within [spreadTimeout]. It is best
// effort: what goes wrong is a line beginning "warning:" and never an error, because the
// streams work wherever their leaders are. It returns "" when the streams are not replicated.
func spreadLeaders(ctx context.Context, js jetstream.JetStream, cfg Config) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, spreadTimeout)
	defer cancel()
	streams := cfg.IncomingStreams(cfg.Layout.Partitions)
	replicated := false
	for _, name := range streams {
		s, err := js.Stream(ctx, name)
		if err != nil {
			return warnSpread(nil, fmt.Sprintf("reading stream %s: %v", name, err), ""), nil
		}
		if s.CachedInfo().Config.Replicas > 1 {
			replicated = true
			break
		}
	}
	if !replicated {
		return "", nil
	}
	ls, err := readLeaderships(ctx, js, streams)
	if err != nil {
		return warnSpread(nil, err.Error(), ""), nil
	}
	before := leaderCounts(ls)
	settleBy := time.Now().Add(settleTimeout)
	moved := 0
	// Each move narrows the spread (it lowers the sum of the squared counts by at least 2), so
	// the loop ends; the bound is for leaderships that keep landing where they were not asked.
	for moved < 4*len(ls) {
		i, to := nextMove(ls)
		if i < 0 {
			if !slices.ContainsFunc(ls, func(l leadership) bool { return l.unsure }) || time.Now().After(settleBy) {
				break
			}
			// A replica not counted may be a server that leads too few, once it is current.
			if !pause(ctx, 100*time.Millisecond) {
				break
			}
			if ls, err = readLeaderships(ctx, js, streams); err != nil {
				return warnSpread(nil, err.Error(), ""), nil
			}
			continue
		}
		from := ls[i].leader
		if err := stepDown(ctx, js, ls[i].stream, to); err != nil {
			return warnSpread(ls, fmt.Sprintf("asking %s's leader %s to hand over to %s: %v", ls[i].stream, from, to, err),
				fmt.Sprintf("`nats stream cluster step-down %s --preferred %s`", ls[i].stream, to)), nil
		}
		l, err := awaitLeader(ctx, js, ls[i].stream)
		if err != nil {
			return warnSpread(ls, fmt.Sprintf("waiting for %s's next leader: %v", ls[i].stream, err), ""), nil
		}
		ls[i] = l
		moved++
	}
	counts := leaderCounts(ls)
	even := "as even as single moves between each stream's replicas allow"
	if spread(counts) <= 1 {
		even = "no two differ by more than one"
	}
	if moved == 0 {
		return fmt.Sprintf("partition streams' leaders over %d servers: %s (%s)", len(counts), formatCounts(counts), even), nil
	}
	return fmt.Sprintf("spread the partition streams' leaders over %d servers: %s (%s; moved %d, they were %s)",
		len(counts), formatCounts(counts), even, moved, formatCounts(before)), nil
}

// warnSpread is the line for a spread that did not finish: what happened, the counts as last
// read, and what the user may do.
func warnSpread(ls []leadership, why, fix string) string {
	if fix == "" {
		fix = "run kvmapper setup again"
	}
	counts := ""
	if ls != nil {
		counts = " (leaders now " + formatCounts(leaderCounts(ls)) + ")"
	}
	return fmt.Sprintf("warning: the partition streams' leaders may not be spread over the servers%s: %s; they work wherever they are led, and setup goes on (to spread them, %s)",
		counts, why, fix)
}

// readLeaderships reads the leadership of every stream, waiting for those electing a leader.
func readLeaderships(ctx context.Context, js jetstream.JetStream, streams []string) ([]leadership, error) {
	ls := make([]leadership, 0, len(streams))
	for _, name := range streams {
		l, err := awaitLeader(ctx, js, name)
		if err != nil {
			return nil, fmt.Errorf("reading the leader of %s: %w", name, err)
		}
		ls = append(ls, l)
	}
	return ls, nil
}

// awaitLeader reads stream's leadership, polling while it has no leader, until ctx is done.
// The requests time out early at first: a stream electing its leader does not answer its info
// requests at all while its servers have run less than 10 s (nats-server's isGroupLeaderless),
// and a leadership handed over is taken within milliseconds.
func awaitLeader(ctx context.Context, js jetstream.JetStream, stream string) (leadership, error) {
	tick, timeout := 10*time.Millisecond, 100*time.Millisecond
	for {
		l, err := readLeadership(ctx, js, stream, timeout)
		if err == nil {
			return l, nil
		}
		if !pause(ctx, tick) {
			return leadership{}, fmt.Errorf("%w (%w)", ctx.Err(), err)
		}
		tick, timeout = min(2*tick, 200*time.Millisecond), min(2*timeout, spreadRequestTimeout)
	}
}

// readLeadership reads stream's leadership from its info, within timeout. A stream electing its
// leader answers nothing, or says it has none: errNoLeader.
func readLeadership(ctx context.Context, js jetstream.JetStream, stream string, timeout time.Duration) (leadership, error) {
	rctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	s, err := js.Stream(rctx, stream)
	if err != nil {
		return leadership{}, err
	}
	ci := s.CachedInfo().Cluster
	if ci == nil || ci.Leader == "" {
		return leadership{}, errNoLeader
	}
	l := leadership{stream: stream, leader: ci.Leader}
	for _, r := range ci.Replicas {
		switch {
		case r == nil || r.Offline:
		case r.Current && r.Active <= liveWindow && r.Name != "":
			l.peers = append(l.peers, r.Name)
		default:
			l.unsure = true
		}
	}
	slices.Sort(l.peers)
	return l, nil
}

// leaderCounts returns how many of ls each server leads, with 0 for a server that holds a
// replica and leads none.
func leaderCounts(ls []leadership) map[string]int {
	counts := map[string]int{}
	for _, l := range ls {
		for _, p := range l.peers {
			counts[p] += 0
		}
		counts[l.leader]++
	}
	return counts
}

// spread is the most leaderships a server has minus the fewest.
func spread(counts map[string]int) int {
	if len(counts) == 0 {
		return 0
	}
	vs := slices.Collect(maps.Values(counts))
	return slices.Max(vs) - slices.Min(vs)
}

// nextMove returns the stream of ls whose leadership to move, and the server to move it to:
// from the server leading the most to a current peer leading at least two fewer, the widest gap
// first (ties: the first stream, then the first peer by name). It returns -1 when no single move
// narrows the spread.
func nextMove(ls []leadership) (int, string) {
	counts := leaderCounts(ls)
	best, to, gap := -1, "", 1
	for i, l := range ls {
		for _, p := range l.peers {
			if g := counts[l.leader] - counts[p]; g > gap {
				best, to, gap = i, p, g
			}
		}
	}
	return best, to
}

// formatCounts writes counts for people, by server name: "n0 5, n1 5, n2 6".
func formatCounts(counts map[string]int) string {
	names := slices.Sorted(maps.Keys(counts))
	parts := make([]string, len(names))
	for i, n := range names {
		parts[i] = fmt.Sprintf("%s %d", n, counts[n])
	}
	return strings.Join(parts, ", ")
}

// stepDown asks stream's leader to hand its leadership to the server named to
// ($JS.API.STREAM.LEADER.STEPDOWN.<stream> with a JetStream placement, nats-server's
// JSApiLeaderStepdownRequest). The server hands it to another current replica when to cannot
// take it, and answers before the new leader is elected.
func stepDown(ctx context.Context, js jetstream.JetStream, stream, to string) error {
	type placement struct {
		Preferred string `json:"preferred"`
	}
	body, err := json.Marshal(struct {
		Placement placement `json:"placement"`
	}{placement{Preferred: to}})
	if err != nil {
		return err
	}
	rctx, cancel := context.WithTimeout(ctx, spreadRequestTimeout)
	defer cancel()
	subject := apiPrefix(js) + "STREAM.LEADER.STEPDOWN." + stream
	resp, err := js.Conn().RequestWithContext(rctx, subject, body)
	if errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
		// A leader always answers, even to refuse: silence is most often a permission.
		return fmt.Errorf("no answer within %v: may this user publish to %s? (docs/security.md, Least privilege)", spreadRequestTimeout, subject)
	}
	if err != nil {
		return err
	}
	var r struct {
		Success bool `json:"success"`
		Error   *struct {
			Code        int    `json:"code"`
			Description string `json:"description"`
		} `json:"error"`
	}
	if err := json.Unmarshal(resp.Data, &r); err != nil {
		return fmt.Errorf("unexpected answer %q", resp.Data)
	}
	if r.Error != nil {
		return fmt.Errorf("the server refused: %s (%d)", r.Error.Description, r.Error.Code)
	}
	if !r.Success {
		return fmt.Errorf("unexpected answer %q", resp.Data)
	}
	return nil
}

// apiPrefix is the JetStream API prefix js sends its requests under, with its trailing dot.
func apiPrefix(js jetstream.JetStream) string {
	o := js.Options()
	switch {
	case o.APIPrefix != "":
		return strings.TrimSuffix(o.APIPrefix, ".") + "."
	case o.Domain != "":
		return "$JS." + o.Domain + ".API."
	}
	return jetstream.DefaultAPIPrefix
}

// pause waits for d or until ctx is done, and reports whether d passed.
func pause(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
