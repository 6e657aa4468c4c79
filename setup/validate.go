package setup

import (
	"fmt"
	"strings"

	"github.com/kvmapper/kvmapper/internal/usage"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// MaxReplicas is the most replicas a JetStream stream or bucket has.
const MaxReplicas = 5

// Validate checks the values of c as they are, the zero ones too: call [Config.Defaults] first to
// give the fields left zero their defaults ([Ensure] does). A Layout is required; Mode, Receive and
// the stream layout must name one ([subjects.AutoLayout] included); the parked names must be
// names. Its errors wrap [ErrInvalidConfig] and say what is wrong as the kvmapper flag of the
// value does: "invalid value 7 for flag --stream-replicas: must be 1 to 5".
func (c Config) Validate() error {
	bad := func(flag string, v any, why string, a ...any) error {
		return usage.Value(ErrInvalidConfig, flag, v, why, a...)
	}
	if c.Layout == nil {
		return fmt.Errorf("%w: Layout is required", ErrInvalidConfig)
	}
	if c.Replicas < 1 || c.Replicas > MaxReplicas {
		return bad("stream-replicas", c.Replicas, "must be 1 to %d", MaxReplicas)
	}
	if _, err := subjects.ParseStreamLayout(string(c.StreamLayout)); err != nil && c.StreamLayout != subjects.AutoLayout {
		return usage.Also(bad("layout", string(c.StreamLayout), "use %s, %s or %s", subjects.AutoLayout, subjects.SingleStream, subjects.PartitionStreams), err)
	}
	if _, err := wire.ParseMode(string(c.Mode)); err != nil {
		return usage.Also(bad("mode", string(c.Mode), "use %s or %s", wire.ModeStream, wire.ModeDirect), err)
	}
	if _, err := wire.ParseReceive(string(c.Receive)); err != nil {
		return usage.Also(bad("direct-receive", string(c.Receive), "use %s or %s", wire.ReceiveMapping, wire.ReceiveAll), err)
	}
	if h := c.GroupsHistory; h < 0 || h > MaxGroupsHistory {
		return bad("groups-history", h, "a bucket keeps 1 to %d values per key", MaxGroupsHistory)
	}
	for _, n := range []struct{ flag, v string }{{"parked-stream", c.Parked}, {"parked-prefix", c.ParkedPrefix}} {
		if v := n.v; strings.ContainsAny(v, " \t\r\n*>") || strings.HasPrefix(v, ".") || strings.HasSuffix(v, ".") || strings.Contains(v, "..") {
			return bad(n.flag, v, "want a name without white space, wildcards or empty tokens")
		}
	}
	if p := c.Park; p != nil {
		switch {
		case c.Mode == wire.ModeDirect:
			return usage.Errorf(ErrInvalidConfig, "--on-unmapped park needs --mode stream: in direct mode no stream holds a device's messages, so nothing can keep the parked ones in order")
		case p.MaxPerDevice < 1:
			return bad("park-max-per-device", p.MaxPerDevice, "at least 1")
		case p.MaxTotal < p.MaxPerDevice:
			return bad("park-max-total", p.MaxTotal, "at least --park-max-per-device (%d)", p.MaxPerDevice)
		}
	}
	return nil
}
