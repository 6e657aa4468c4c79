package replay

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/kvmapper/kvmapper/subjects"
)

// Templates returns the templates a replay into stream into publishes with, from the live
// mapper's layout: out and dead as given, or, when empty, the defaults. A replay into another
// stream than outgoing (the live OUTGOING) publishes under that stream's name in lower case
// (REPLAY: replay.{group}.{device}.{event}), and its dead letters under that prefix with
// "-unmapped" (replay-unmapped.{device}.{event}); a replay into OUTGOING uses the live out and
// unmapped templates. It fails wrapping [subjects.ErrInvalidTemplate] for a bad out.
func Templates(live *subjects.Layout, outgoing, into, out, dead string) (string, string, error) {
	toOutgoing := into == outgoing
	if out == "" {
		out = live.Out.String()
		if !toOutgoing {
			out = strings.ToLower(into) + strings.TrimPrefix(live.Out.String(), live.Out.Prefix())
		}
	}
	if dead == "" {
		dead = live.Unmapped.String()
		if !toOutgoing {
			o, err := subjects.ParseTemplate(out)
			if err != nil {
				return "", "", err
			}
			dead = o.Prefix() + "-unmapped" + strings.TrimPrefix(live.Unmapped.String(), live.Unmapped.Prefix())
		}
	}
	return out, dead, nil
}

// ParseWhen reads an RFC 3339 time, or a duration meaning that long before now (2h).
func ParseWhen(v string, now time.Time) (time.Time, error) {
	if d, err := time.ParseDuration(v); err == nil {
		if d < 0 {
			d = -d
		}
		return now.Add(-d), nil
	}
	return time.Parse(time.RFC3339Nano, v)
}

// ParseAsOf reads which groups table to map with: "now" (or ""), a revision of the groups
// bucket, or a time as [ParseWhen] reads it.
func ParseAsOf(v string, now time.Time) (AsOf, error) {
	if v == "now" || v == "" {
		return AsOf{}, nil
	}
	if rev, err := strconv.ParseUint(v, 10, 64); err == nil {
		return AsOf{Revision: rev}, nil
	}
	t, err := ParseWhen(v, now)
	if err != nil {
		return AsOf{}, fmt.Errorf("use now, a revision or a time (%v)", err)
	}
	return AsOf{Time: t}, nil
}
