package replay

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// source is one stream a replay reads and its range: INCOMING (filtered on one partition when
// only one is replayed), or one partition's stream.
type source struct {
	Stream      string `json:"stream"`
	Incarnation string `json:"incarnation"`
	Filter      string `json:"filter,omitempty"`
	First       uint64 `json:"first"`
	Last        uint64 `json:"last"` // below First when the range is empty
	// Done is the last sequence of the contiguous replayed prefix: First-1 before the first.
	Done uint64 `json:"done"`
}

func (s *source) size() uint64 {
	if s.Last < s.First {
		return 0
	}
	return s.Last - s.First + 1
}

func (s *source) done() uint64 { return min(s.Done+1-s.First, s.size()) }

// partitions returns which partitions the replay reads, as a set indexed by partition: those
// asked for, narrowed to those of the devices asked for.
func (c *Config) partitions() []bool {
	set := make([]bool, c.Layout.Partitions)
	all := len(c.Partitions) == 0
	for _, p := range c.Partitions {
		set[p] = true
	}
	if len(c.Devices) == 0 {
		if all {
			for p := range set {
				set[p] = true
			}
		}
		return set
	}
	dev := make([]bool, len(set))
	for _, d := range c.Devices {
		p := subjects.Partition(d, len(set))
		dev[p] = all || set[p]
	}
	return dev
}

// openSources lists the streams to read, with their incarnations, unresolved.
func (r *Replay) openSources(ctx context.Context) ([]source, error) {
	c := &r.cfg
	var out []source
	add := func(stream, filter string) error {
		s, err := r.js.Stream(ctx, stream)
		if err != nil {
			return fmt.Errorf("replay: reading stream %s: %w", stream, err)
		}
		out = append(out, source{Stream: stream, Filter: filter, Incarnation: wire.Incarnation(s.CachedInfo().Created)})
		return nil
	}
	var parts []int
	for p, ok := range r.parts {
		if ok {
			parts = append(parts, p)
		}
	}
	if c.Names.StreamLayout == subjects.PartitionStreams {
		for _, p := range parts {
			if err := add(c.Names.PartitionStream(p), ""); err != nil {
				return nil, err
			}
		}
		return out, nil
	}
	filter := ""
	if len(parts) == 1 {
		// One filter subject: a filtered read walks the stream, and more filters cost more.
		filter = c.Layout.Filter(parts[0])
	}
	if err := add(c.Names.Incoming, filter); err != nil {
		return nil, err
	}
	return out, nil
}

// resolve sets the range of each source from the configuration, against the streams as they are
// now: times become sequences, an open end the stream's last message.
func (r *Replay) resolve(ctx context.Context, srcs []source) error {
	c := &r.cfg
	for i := range srcs {
		s := &srcs[i]
		st, err := r.js.Stream(ctx, s.Stream)
		if err != nil {
			return fmt.Errorf("replay: reading stream %s: %w", s.Stream, err)
		}
		state := st.CachedInfo().State
		s.First, s.Last = c.FromSeq, state.LastSeq
		if !c.FromTime.IsZero() {
			seq, found, err := r.msgAt(ctx, s.Stream, msgGet{StartTime: &c.FromTime, NextFor: cmp.Or(s.Filter, ">")})
			if err != nil {
				return err
			}
			s.First = seq
			if !found {
				s.First = state.LastSeq + 1
			}
		}
		switch {
		case c.ToSeq > 0:
			s.Last = min(c.ToSeq, state.LastSeq)
		case !c.ToTime.IsZero():
			seq, found, err := r.msgAt(ctx, s.Stream, msgGet{StartTime: &c.ToTime, NextFor: ">"})
			if err != nil {
				return err
			}
			if found {
				s.Last = seq - 1
			}
		}
		if s.First < state.FirstSeq && s.First <= s.Last {
			r.log.Warn().Str("stream", s.Stream).Uint64("from", s.First).Uint64("first_held", state.FirstSeq).
				Msg("the range starts before the stream's first message: the messages before it are gone")
			s.First = state.FirstSeq
		}
		if s.First == 0 {
			s.First = 1
		}
		s.Done = s.First - 1
	}
	return nil
}

// msgGet is the JetStream API's message get request (nats-server JSApiMsgGetRequest): the first
// message at or after StartTime, or at or after Seq, on a subject matching NextFor.
type msgGet struct {
	Seq       uint64     `json:"seq,omitempty"`
	NextFor   string     `json:"next_by_subj,omitempty"`
	StartTime *time.Time `json:"start_time,omitempty"`
}

// errCodeNoMessageFound is nats-server's JSNoMessageFoundErr.
const errCodeNoMessageFound jetstream.ErrorCode = 10037

// msgAt returns the sequence of the message req finds in stream; found is false when there is
// none. nats.go's Stream.GetMsg has no option for a start time.
func (r *Replay) msgAt(ctx context.Context, stream string, req msgGet) (seq uint64, found bool, err error) {
	body, err := json.Marshal(req)
	if err != nil {
		return 0, false, err
	}
	prefix := cmp.Or(r.js.Options().APIPrefix, jetstream.DefaultAPIPrefix)
	if !strings.HasSuffix(prefix, ".") {
		prefix += "."
	}
	m, err := r.js.Conn().RequestWithContext(ctx, prefix+"STREAM.MSG.GET."+stream, body)
	if err != nil {
		return 0, false, fmt.Errorf("replay: looking up a message of stream %s: %w", stream, err)
	}
	var resp struct {
		Error   *jetstream.APIError `json:"error"`
		Message *struct {
			Seq uint64 `json:"seq"`
		} `json:"message"`
	}
	if err := json.Unmarshal(m.Data, &resp); err != nil {
		return 0, false, fmt.Errorf("replay: looking up a message of stream %s: %w", stream, err)
	}
	switch {
	case resp.Error != nil && resp.Error.ErrorCode == errCodeNoMessageFound:
		return 0, false, nil
	case resp.Error != nil:
		return 0, false, fmt.Errorf("replay: looking up a message of stream %s: %w", stream, resp.Error)
	case resp.Message == nil:
		return 0, false, fmt.Errorf("replay: looking up a message of stream %s: %w", stream, errors.New("empty answer"))
	}
	return resp.Message.Seq, true, nil
}

// asOfRevision returns the revision of the groups bucket the replay maps with: the last one
// written at or before the configured time, the configured revision, or the last one now.
func (r *Replay) asOfRevision(ctx context.Context) (uint64, error) {
	c := &r.cfg
	if c.AsOf.Revision > 0 {
		return c.AsOf.Revision, nil
	}
	stream := subjects.BucketStream(c.Names.Groups)
	s, err := r.js.Stream(ctx, stream)
	if err != nil {
		return 0, fmt.Errorf("replay: reading the groups bucket %s: %w", c.Names.Groups, err)
	}
	info := s.CachedInfo()
	if c.AsOf.Time.IsZero() {
		return info.State.LastSeq, nil
	}
	if c.AsOf.Time.Before(info.Created) {
		return 0, nil
	}
	// The first write after the time, not at it: a change made at that very time counts.
	after := c.AsOf.Time.Add(time.Nanosecond)
	seq, found, err := r.msgAt(ctx, stream, msgGet{StartTime: &after, NextFor: ">"})
	if err != nil {
		return 0, err
	}
	if !found {
		return info.State.LastSeq, nil
	}
	return seq - 1, nil
}
