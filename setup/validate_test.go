package setup_test

import (
	"errors"
	"testing"

	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// Validate refuses, before anything dials, every value a run could not use, naming the flag of
// the value as kvmapper shows it; it checks the values as they are, so that a zero given on the
// command line is refused, while Defaults then Validate accepts a Config left zero.
func TestValidate(t *testing.T) {
	t.Parallel()
	valid := func() setup.Config {
		c := setup.Config{Layout: layout(t, 16)}
		c.Defaults()
		return c
	}
	if err := valid().Validate(); err != nil {
		t.Fatalf("Validate() of a defaulted Config = %v, want nil", err)
	}
	park := func(per, total int64) func(*setup.Config) {
		return func(c *setup.Config) { c.Park = &setup.ParkedStream{MaxPerDevice: per, MaxTotal: total} }
	}
	for _, tc := range []struct {
		name   string
		change func(*setup.Config)
		want   string
	}{
		{"no layout", func(c *setup.Config) { c.Layout = nil }, "setup: invalid config: Layout is required"},
		{"zero replicas", func(c *setup.Config) { c.Replicas = 0 }, "invalid value 0 for flag --stream-replicas: must be 1 to 5"},
		{"six replicas", func(c *setup.Config) { c.Replicas = 6 }, "invalid value 6 for flag --stream-replicas: must be 1 to 5"},
		{"stream layout", func(c *setup.Config) { c.StreamLayout = "sharded" }, `invalid value "sharded" for flag --layout: use auto, single or streams`},
		{"mode", func(c *setup.Config) { c.Mode = "fast" }, `invalid value "fast" for flag --mode: use stream or direct`},
		{"receive", func(c *setup.Config) { c.Receive = "some" }, `invalid value "some" for flag --direct-receive: use mapping or all`},
		{"history", func(c *setup.Config) { c.GroupsHistory = 65 }, "invalid value 65 for flag --groups-history: a bucket keeps 1 to 64 values per key"},
		{"negative history", func(c *setup.Config) { c.GroupsHistory = -1 }, "invalid value -1 for flag --groups-history: a bucket keeps 1 to 64 values per key"},
		{"parked stream", func(c *setup.Config) { c.Parked = "a.b." }, `invalid value "a.b." for flag --parked-stream: want a name without white space, wildcards or empty tokens`},
		{"parked prefix", func(c *setup.Config) { c.ParkedPrefix = "x*" }, `invalid value "x*" for flag --parked-prefix: want a name without white space, wildcards or empty tokens`},
		{"park in direct mode", func(c *setup.Config) { park(1, 1)(c); c.Mode = wire.ModeDirect },
			"--on-unmapped park needs --mode stream: in direct mode no stream holds a device's messages, so nothing can keep the parked ones in order"},
		{"park none per device", park(0, 10), "invalid value 0 for flag --park-max-per-device: at least 1"},
		{"park total below per device", park(10, 5), "invalid value 5 for flag --park-max-total: at least --park-max-per-device (10)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := valid()
			tc.change(&c)
			err := c.Validate()
			if err == nil || err.Error() != tc.want || !errors.Is(err, setup.ErrInvalidConfig) {
				t.Fatalf("Validate() = %v, want an ErrInvalidConfig saying %q", err, tc.want)
			}
		})
	}
	for _, sl := range []subjects.StreamLayout{subjects.AutoLayout, subjects.SingleStream, subjects.PartitionStreams} {
		c := valid()
		c.StreamLayout = sl
		park(1, 1)(&c)
		if err := c.Validate(); err != nil {
			t.Errorf("Validate() with layout %s and parking = %v, want nil", sl, err)
		}
	}
	left := setup.Config{Layout: layout(t, 16), Park: &setup.ParkedStream{}}
	left.Defaults()
	if err := left.Validate(); err != nil {
		t.Errorf("Validate() of a defaulted Config that parks = %v, want nil", err)
	}
}
