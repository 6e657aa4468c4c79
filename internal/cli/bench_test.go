package cli

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

// The bench's list flags are checked before anything starts: a bad value, or a list with what
// a sweep cannot do, is a usage error that names the fix.
func TestBenchFlagsRefused(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--messages", "1000,many"}, `invalid value "many" for flag --messages`},
		{[]string{"--replicas", "0"}, `invalid value "0" for flag --replicas`},
		{[]string{"--layout", "single,sharded"}, `invalid value "sharded" for flag --layout`},
		{[]string{"--contenders", "kvmapper,fastest"}, `invalid value "fastest" for flag --contenders`},
		{[]string{"--profile-contender", "nobody"}, `invalid value "nobody" for flag --profile-contender`},
		{[]string{"--messages", "1000,2000", "--only", "latency"}, "run the throughput bench only"},
		{[]string{"--replicas", "1,3", "--cpuprofile", "/dev/null"}, "profiles cover one run"},
		{[]string{"--partitions", "16,64"}, "need the bench's own server"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var out, errOut bytes.Buffer
			// A server nobody listens on: a check that let the command through would fail
			// at once, not start a server.
			args := append([]string{"kvmapper", "bench", "--server", "nats://127.0.0.1:1"}, tc.args...)
			err := newApp(&out, &errOut, Build{}).Run(args)
			var ue usageError
			if !errors.As(err, &ue) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("kvmapper bench %v: %v, want a usage error containing %q", tc.args, err, tc.want)
			}
		})
	}
}
