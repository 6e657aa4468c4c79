package election_test

import (
	"fmt"
	"slices"
	"testing"

	"github.com/kvmapper/kvmapper/election"
)

const rankP = 16

func assign(members []string) []string {
	owners := make([]string, rankP)
	for p := range owners {
		owners[p] = election.Rank(p, members)
	}
	return owners
}

func moved(a, b []string) int {
	n := 0
	for p := range a {
		if a[p] != b[p] {
			n++
		}
	}
	return n
}

func TestRankEmpty(t *testing.T) {
	t.Parallel()
	if got := election.Rank(3, nil); got != "" {
		t.Fatalf("Rank(3, nil) = %q, want \"\"", got)
	}
	if got := election.Rank(3, []string{"solo"}); got != "solo" {
		t.Fatalf("Rank(3, [solo]) = %q, want solo", got)
	}
}

func TestRankDeterministic(t *testing.T) {
	t.Parallel()
	a := []string{"replica-a", "replica-b", "replica-c"}
	b := []string{"replica-c", "replica-a", "replica-b", "replica-a"} // order and duplicates do not matter
	for p := range rankP {
		if x, y := election.Rank(p, a), election.Rank(p, b); x != y {
			t.Fatalf("Rank(%d, %v) = %s, Rank(%d, %v) = %s, want equal", p, a, x, p, b, y)
		}
	}
}

func TestRankSpread(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		members []string
	}{
		{"replica-n", []string{"replica-0", "replica-1", "replica-2"}},
		{"letters", []string{"a", "b", "c"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			count := map[string]int{}
			for _, o := range assign(tt.members) {
				count[o]++
			}
			for _, m := range tt.members {
				if c := count[m]; c < rankP/3-2 || c > rankP/3+2+1 { // 16/3 ± 2 → 4…7
					t.Errorf("member %s ranks first for %d of %d partitions, want 4…7 (%v)", m, c, rankP, count)
				}
			}
		})
	}
}

func TestRankAddMember(t *testing.T) {
	t.Parallel()
	three := []string{"a", "b", "c"}
	four := append(slices.Clone(three), "d")
	before, after := assign(three), assign(four)
	if n, limit := moved(before, after), (rankP+3)/4+1; n > limit {
		t.Fatalf("adding a 4th member moved %d partitions, want ≤ %d", n, limit)
	}
	for p := range before {
		if before[p] != after[p] && after[p] != "d" {
			t.Errorf("partition %d moved %s → %s, want moves only to the new member", p, before[p], after[p])
		}
	}
}

func TestRankRemoveMember(t *testing.T) {
	t.Parallel()
	four := []string{"replica-0", "replica-1", "replica-2", "replica-3"}
	three := []string{"replica-0", "replica-2", "replica-3"}
	before, after := assign(four), assign(three)
	for p := range before {
		if before[p] != after[p] && before[p] != "replica-1" {
			t.Errorf("partition %d moved %s → %s, want only replica-1's partitions to move", p, before[p], after[p])
		}
	}
}

// TestRankStatistics measures HRW over many member sets. Rendezvous hashing balances only in
// expectation (each member's count is binomial), so it checks the means and logs the spread.
func TestRankStatistics(t *testing.T) {
	t.Parallel()
	const sets = 2000
	balanced, smallMove, totalMoved := 0, 0, 0
	for s := range sets {
		three := []string{fmt.Sprintf("r%d-a", s), fmt.Sprintf("r%d-b", s), fmt.Sprintf("r%d-c", s)}
		four := append(slices.Clone(three), fmt.Sprintf("r%d-d", s))
		count := map[string]int{}
		for _, o := range assign(three) {
			count[o]++
		}
		if min(count[three[0]], count[three[1]], count[three[2]]) >= 4 &&
			max(count[three[0]], count[three[1]], count[three[2]]) <= 7 {
			balanced++
		}
		n := moved(assign(three), assign(four))
		totalMoved += n
		if n <= 5 {
			smallMove++
		}
	}
	mean := float64(totalMoved) / sets
	t.Logf("P=16 over 2000 member sets: %.1f%% of 3-member spreads within 4…7 each; 3→4 moves %.2f on average, ≤ 5 in %.1f%%",
		100*float64(balanced)/sets, mean, 100*float64(smallMove)/sets)
	if mean < 3.5 || mean > 4.5 {
		t.Fatalf("mean partitions moved on 3→4 = %.2f, want ≈ 16/4 = 4", mean)
	}
}
