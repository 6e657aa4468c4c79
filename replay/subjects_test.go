package replay_test

import (
	"testing"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/kvmapper/kvmapper/replay"
)

// The replay's subject checks agree with the server's own on every pair of a set of patterns.
func TestSubjectChecksAgreeWithTheServer(t *testing.T) {
	patterns := []string{
		"replay.>", "replay.*.*.*", "replay.g.d.e", "replay.*.d.*", "replay.*", "replay",
		"replay-unmapped.>", "replay-unmapped.*.*", "outgoing.>", "outgoing.*.*.*", ">", "*", "*.*.*.*",
		"replay.g.>", "replay.*.>", "a.b.c",
	}
	for _, a := range patterns {
		for _, b := range patterns {
			if got, want := replay.Collide(a, b), server.SubjectsCollide(a, b); got != want {
				t.Errorf("collide(%q, %q) = %v, server says %v", a, b, got, want)
			}
			if got, want := replay.SubsetOf(a, b), server.SubjectMatchesFilter(a, b); got != want {
				t.Errorf("subsetOf(%q, %q) = %v, server says %v", a, b, got, want)
			}
		}
	}
}
