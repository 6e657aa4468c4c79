package setup

import (
	"maps"
	"testing"
)

// TestNextMoveNarrowsTheSpread applies nextMove's moves to made-up placements until it finds
// none, and checks where they end: every server within one of the others when every stream
// may go anywhere, and as even as the replica sets allow when they may not.
func TestNextMoveNarrowsTheSpread(t *testing.T) {
	t.Parallel()
	all := func(n int, leader string, peers ...string) []leadership {
		ls := make([]leadership, n)
		for i := range ls {
			ls[i] = leadership{stream: "s", leader: leader, peers: peers}
		}
		return ls
	}
	for _, tc := range []struct {
		name  string
		ls    []leadership
		moves int
		want  map[string]int
	}{
		{"16 on one of 3", all(16, "a", "b", "c"), 10, map[string]int{"a": 6, "b": 5, "c": 5}},
		{"already even", append(append(all(6, "a", "b", "c"), all(5, "b", "a", "c")...), all(5, "c", "a", "b")...), 0,
			map[string]int{"a": 6, "b": 5, "c": 5}},
		{"a server out of reach", all(16, "a", "b"), 8, map[string]int{"a": 8, "b": 8}},
		// R3 on 5 servers: a, b, c hold 12 streams, c, d, e hold 4; c is in both. No placement
		// does better: a, b and c lead 12 between them.
		{"replica sets overlap on one server", append(all(12, "a", "b", "c"), all(4, "e", "c", "d")...), 10,
			map[string]int{"a": 4, "b": 4, "c": 4, "d": 2, "e": 2}},
		{"replica sets apart", append(all(12, "a", "b", "c"), all(3, "d", "e", "f")...), 10,
			map[string]int{"a": 4, "b": 4, "c": 4, "d": 1, "e": 1, "f": 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			moves := 0
			for ; moves <= 4*len(tc.ls); moves++ {
				i, to := nextMove(tc.ls)
				if i < 0 {
					break
				}
				l := &tc.ls[i]
				peers := []string{l.leader}
				for _, p := range l.peers {
					if p != to {
						peers = append(peers, p)
					}
				}
				l.leader, l.peers = to, peers
			}
			if got := leaderCounts(tc.ls); !maps.Equal(got, tc.want) || moves != tc.moves {
				t.Errorf("after %d moves, leaders %v; want %v after %d", moves, got, tc.want, tc.moves)
			}
		})
	}
}
