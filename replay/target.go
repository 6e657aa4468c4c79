package replay

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/subjects"
)

// targets are the streams a replay publishes to: Into for mapped messages, and the stream that
// captures its dead letters (Into itself, or another, e.g. UNMAPPED).
type targets struct {
	into, dead string
}

// openTargets checks Into and finds where dead letters go, creating Into if asked. In a dry run
// nothing is created and a missing Into is no error.
func (r *Replay) openTargets(ctx context.Context) (targets, error) {
	c := &r.cfg
	n := c.Names
	t := targets{into: c.Into}
	outPat, deadPat := c.Layout.Out.Wildcard(), c.Layout.Unmapped.Wildcard()
	switch {
	case slices.Contains(n.IncomingStreams(c.Layout.Partitions), c.Into) || (n.StreamLayout == subjects.PartitionStreams && strings.HasPrefix(c.Into, n.Incoming+"-")):
		return t, fmt.Errorf("%w: %s holds INCOMING messages: replaying into it would loop", ErrTarget, c.Into)
	case c.Into == n.Unmapped:
		return t, fmt.Errorf("%w: %s is the live mapper's dead-letter stream", ErrTarget, c.Into)
	case strings.HasPrefix(c.Into, "KV_"):
		return t, fmt.Errorf("%w: %s is a KV bucket's stream", ErrTarget, c.Into)
	case c.Into == n.Outgoing && !c.IntoOutgoing:
		return t, fmt.Errorf("%w: %s is the live mapper's output, whose consumers would receive every replayed message besides the live ones; confirm with --yes-into-outgoing, or replay into a stream of its own", ErrTarget, c.Into)
	}
	var outSubjects []string
	if s, err := r.js.Stream(ctx, n.Outgoing); err == nil {
		outSubjects = s.CachedInfo().Config.Subjects
	} else if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return t, fmt.Errorf("replay: reading stream %s: %w", n.Outgoing, err)
	}
	if c.Into != n.Outgoing {
		for _, o := range outSubjects {
			if collide(outPat, o) {
				return t, fmt.Errorf("%w: the out template %q renders subjects that %s captures (%q): give the replay's --out another first token, e.g. replay.{group}.{device}.{event}", ErrTarget, c.Layout.Out, n.Outgoing, o)
			}
		}
	}

	var into *jetstream.StreamInfo
	s, err := r.js.Stream(ctx, c.Into)
	switch {
	case err == nil:
		into = s.CachedInfo()
	case !errors.Is(err, jetstream.ErrStreamNotFound):
		return t, fmt.Errorf("replay: reading stream %s: %w", c.Into, err)
	case c.DryRun:
	case !c.Create:
		return t, fmt.Errorf("%w: stream %s does not exist: create it (--create makes one capturing %s and %s)", ErrTarget, c.Into, c.Layout.OutStreamSubject(), c.Layout.UnmappedStreamSubject())
	}
	// Dead letters go to the stream capturing their subjects: Into, another stream, or a new
	// Into that is made to capture them.
	deadIn, err := r.captures(ctx, deadPat)
	if err != nil {
		return t, err
	}
	if into == nil && !c.DryRun {
		subs := []string{c.Layout.OutStreamSubject()}
		if deadIn == "" {
			subs = append(subs, c.Layout.UnmappedStreamSubject())
		}
		s, err := r.js.CreateStream(ctx, jetstream.StreamConfig{
			Name:        c.Into,
			Description: "kvmapper replay output",
			Subjects:    subs,
			Storage:     jetstream.FileStorage,
			Retention:   jetstream.LimitsPolicy,
			Duplicates:  c.DuplicateWindow,
			Replicas:    c.Replicas,
			// Written in batches (package ordered): nothing later of a device is stored
			// before an earlier one, through a leader change too.
			AllowBatchPublish:  true,
			AllowAtomicPublish: true,
		})
		if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			s, err = r.js.Stream(ctx, c.Into)
		}
		if err != nil {
			return t, fmt.Errorf("%w: creating stream %s with subjects %v: %w", ErrTarget, c.Into, subs, err)
		}
		into = s.CachedInfo()
		r.log.Info().Str("stream", c.Into).Strs("subjects", into.Config.Subjects).Msg("created the stream to replay into")
		if deadIn == "" {
			deadIn = c.Into
		}
	}
	if into != nil && !covers(into.Config.Subjects, outPat) {
		return t, fmt.Errorf("%w: stream %s captures %v, not every subject of the out template %q: add %q to it, or choose another --out", ErrTarget, c.Into, into.Config.Subjects, c.Layout.Out, c.Layout.OutStreamSubject())
	}
	switch {
	case deadIn != "":
	case c.DryRun:
		deadIn = c.Into
	default:
		return t, fmt.Errorf("%w: no stream captures the replay's dead letters (%q): add %q to %s, or choose --dead-letters", ErrTarget, c.Layout.Unmapped, c.Layout.UnmappedStreamSubject(), c.Into)
	}
	if slices.Contains(n.IncomingStreams(c.Layout.Partitions), deadIn) || strings.HasPrefix(deadIn, "KV_") {
		return t, fmt.Errorf("%w: the dead-letter template %q renders subjects of stream %s", ErrTarget, c.Layout.Unmapped, deadIn)
	}
	if deadIn == n.Outgoing && c.Into != n.Outgoing {
		return t, fmt.Errorf("%w: the dead-letter template %q renders subjects of %s", ErrTarget, c.Layout.Unmapped, n.Outgoing)
	}
	t.dead = deadIn
	for _, name := range t.list() {
		if name == c.Into && into != nil {
			r.maxSize[name] = int(into.Config.MaxMsgSize)
			continue
		}
		if s, err := r.js.Stream(ctx, name); err == nil {
			r.maxSize[name] = int(s.CachedInfo().Config.MaxMsgSize)
		}
	}
	return t, nil
}

// captures returns the stream whose subjects cover every subject matching pattern, or "" when no
// stream captures any of them. A stream that captures only some is an error.
func (r *Replay) captures(ctx context.Context, pattern string) (string, error) {
	names := r.js.StreamNames(ctx, jetstream.WithStreamListSubject(pattern))
	var found []string
	for name := range names.Name() {
		found = append(found, name)
	}
	if err := names.Err(); err != nil {
		return "", fmt.Errorf("replay: looking up the stream that captures %q: %w", pattern, err)
	}
	var partial error
	for _, name := range found {
		s, err := r.js.Stream(ctx, name)
		if err != nil {
			return "", fmt.Errorf("replay: reading stream %s: %w", name, err)
		}
		if covers(s.CachedInfo().Config.Subjects, pattern) {
			return name, nil
		}
		partial = fmt.Errorf("%w: stream %s captures some subjects of %q but not all (%v)", ErrTarget, name, pattern, s.CachedInfo().Config.Subjects)
	}
	return "", partial
}

// covers reports whether every subject that matches pattern matches one of filters.
func covers(filters []string, pattern string) bool {
	return slices.ContainsFunc(filters, func(f string) bool { return subsetOf(pattern, f) })
}

// subsetOf reports whether every subject matching pattern also matches filter ('*' and '>'
// wildcards in both).
func subsetOf(pattern, filter string) bool {
	pt, ft := strings.Split(pattern, "."), strings.Split(filter, ".")
	for i, f := range ft {
		if f == ">" {
			return len(pt) > i
		}
		if i >= len(pt) {
			return false
		}
		switch p := pt[i]; {
		case p == ">":
			return false
		case f == "*":
		case p == "*" || p != f:
			return false
		}
	}
	return len(pt) == len(ft)
}

// collide reports whether some subject matches both patterns a and b.
func collide(a, b string) bool {
	at, bt := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; i < len(at) && i < len(bt); i++ {
		x, y := at[i], bt[i]
		if x == ">" || y == ">" {
			return true
		}
		if x != "*" && y != "*" && x != y {
			return false
		}
	}
	return len(at) == len(bt)
}
