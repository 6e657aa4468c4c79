package election_test

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvmapper/kvmapper/election"
)

var planPartitions = []int{1, 7, 16, 64}

func TestQuota(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name       string
		partitions int
		members    []string
		want       map[string]int
	}{
		{"alone", 16, []string{"r0"}, map[string]int{"r0": 16}},
		{"16 over 3", 16, []string{"r0", "r1", "r2"}, map[string]int{"r0": 6, "r1": 5, "r2": 5}},
		{"16 over 4", 16, []string{"r3", "r1", "r0", "r2"}, map[string]int{"r0": 4, "r1": 4, "r2": 4, "r3": 4}},
		{"order and duplicates", 7, []string{"c", "a", "b", "a"}, map[string]int{"a": 3, "b": 2, "c": 2}},
		{"fewer partitions than members", 2, []string{"z", "y", "x"}, map[string]int{"x": 1, "y": 1, "z": 0}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for m, want := range tt.want {
				if got := election.Quota(tt.partitions, tt.members, m); got != want {
					t.Errorf("Quota(%d, %v, %s) = %d, want %d", tt.partitions, tt.members, m, got, want)
				}
			}
		})
	}
	if got := election.Quota(16, []string{"r1", "r2"}, "r0"); got != 6 {
		t.Errorf("Quota(16, [r1 r2], r0) = %d, want 6: me counts as a member", got)
	}
}

// TestQuotaProperty checks that the quotas of n members sum to P and differ by at most one, for
// any ids.
func TestQuotaProperty(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(1, 2))
	for _, P := range planPartitions {
		for n := 1; n <= 10; n++ {
			for range 20 {
				members := randomIDs(rng, n)
				sum, lo, hi := 0, P, 0
				for _, m := range members {
					q := election.Quota(P, members, m)
					sum += q
					lo, hi = min(lo, q), max(hi, q)
				}
				if sum != P || hi-lo > 1 || lo != P/n {
					t.Fatalf("Quota(%d, %v, ·): sum %d, range %d…%d, want sum %d and %d…%d", P, members, sum, lo, hi, P, P/n, (P+n-1)/n)
				}
			}
		}
	}
}

func TestPlan(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name         string
		me           string
		members      []string
		owners       []string
		claim, relse int // how many
	}{
		{"alone, all free", "a", nil, []string{"", "", "", ""}, 4, 0},
		{"balanced", "a", []string{"a", "b"}, []string{"a", "b", "a", "b"}, 0, 0},
		{"over quota after a join", "a", []string{"a", "b"}, []string{"a", "a", "a", "a"}, 0, 2},
		{"under quota, one free", "b", []string{"a", "b"}, []string{"a", "a", "a", ""}, 1, 0},
		{"departed owner's lease is not free", "a", []string{"a"}, []string{"a", "gone", "", ""}, 2, 0},
		{"releasing partitions still count", "a", []string{"a", "b", "c"}, []string{"a", "a", "a", "b", "c", "a"}, 0, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			claim, release := election.Plan(tt.me, tt.members, tt.owners)
			if len(claim) != tt.claim || len(release) != tt.relse {
				t.Fatalf("Plan(%s, %v, %q) = claim %v, release %v; want %d claims, %d releases", tt.me, tt.members, tt.owners, claim, release, tt.claim, tt.relse)
			}
			for _, p := range claim {
				if tt.owners[p] != "" {
					t.Errorf("Plan claims partition %d owned by %q, want only free ones", p, tt.owners[p])
				}
			}
			for _, p := range release {
				if tt.owners[p] != tt.me {
					t.Errorf("Plan releases partition %d owned by %q, want only %s's", p, tt.owners[p], tt.me)
				}
			}
		})
	}
}

// TestPlanPreference checks that the order of preference depends only on the replica's id, and
// that over quota a replica keeps the partitions it would claim first.
func TestPlanPreference(t *testing.T) {
	t.Parallel()
	const P = 16
	claim, _ := election.Plan("a", nil, make([]string, P))
	again, _ := election.Plan("a", []string{"z", "a"}, make([]string, P))
	if !slices.Equal(again[:8], claim[:8]) {
		t.Errorf("Plan(a, [z a], all free) claims %v, want a's first 8 when alone: %v", again, claim[:8])
	}
	all := slices.Repeat([]string{"a"}, P)
	_, release := election.Plan("a", []string{"a", "b", "c", "d", "e", "f", "g", "h"}, all)
	var kept []int
	for p := range P {
		if !slices.Contains(release, p) {
			kept = append(kept, p)
		}
	}
	if !sameSet(kept, claim[:2]) {
		t.Errorf("Plan(a, 8 members, a owns all) keeps %v, want a's two favourites %v", kept, claim[:2])
	}
}

// TestPlanJoinLeave checks the balancing properties on random ids: from empty, n replicas reach
// a balanced assignment; a joining replica moves at most ⌈P/(n+1)⌉+1 partitions (in fact its
// quota, all to it) and balance holds; a leaving replica moves only its own partitions. It
// checks every member set, not an average.
func TestPlanJoinLeave(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(3, 4))
	sets := 0
	for _, P := range planPartitions {
		for n := 1; n <= 9; n++ {
			for range 200 / len(planPartitions) {
				sets++
				ids := randomIDs(rng, n+1)
				members, joiner := ids[:n], ids[n]
				owners := converge(t, rng, members, make([]string, P))
				checkBalanced(t, members, owners)
				for _, m := range members {
					if claim, release := election.Plan(m, members, owners); len(claim)+len(release) > 0 {
						t.Fatalf("Plan(%s, %v, balanced %q) = claim %v, release %v; want a no-op", m, members, owners, claim, release)
					}
				}

				after := converge(t, rng, ids, slices.Clone(owners))
				checkBalanced(t, ids, after)
				moved := 0
				for p := range owners {
					if owners[p] != after[p] {
						moved++
						if after[p] != joiner {
							t.Errorf("P=%d %v + %s: partition %d moved %s → %s, want moves only to the joiner", P, members, joiner, p, owners[p], after[p])
						}
					}
				}
				if limit := (P+n)/(n+1) + 1; moved > limit {
					t.Fatalf("P=%d %v + %s: %d partitions moved, want ≤ ⌈P/(n+1)⌉+1 = %d", P, members, joiner, moved, limit)
				}
				if q := election.Quota(P, ids, joiner); moved != q {
					t.Errorf("P=%d %v + %s: %d partitions moved, want the joiner's quota %d", P, members, joiner, moved, q)
				}

				if len(ids) < 2 {
					continue
				}
				gone := ids[rng.IntN(len(ids))]
				survivors := slices.DeleteFunc(slices.Clone(ids), func(m string) bool { return m == gone })
				left := slices.Clone(after)
				for p, o := range left {
					if o == gone {
						left[p] = "" // its leases expire
					}
				}
				final := converge(t, rng, survivors, left)
				checkBalanced(t, survivors, final)
				for p := range after {
					if after[p] != gone && final[p] != after[p] {
						t.Errorf("P=%d %v − %s: partition %d moved %s → %s, want only %s's to move", P, ids, gone, p, after[p], final[p], gone)
					}
				}
			}
		}
	}
	t.Logf("checked %d member sets", sets)
}

// converge runs the replicas in members until none wants to change anything. Each round every
// replica plans from the same snapshot, as replicas watching the same bucket would, releases
// what it plans to release, and claims in random order, a claim succeeding only while the
// partition is still free (the CAS). It fails the test when a replica ever owns more than its
// quota or the assignment does not settle within a few rounds.
func converge(t *testing.T, rng *rand.Rand, members, owners []string) []string {
	t.Helper()
	type plan struct {
		m              string
		claim, release []int
	}
	for round := 0; round < 10; round++ {
		var plans []plan
		for _, m := range members {
			c, r := election.Plan(m, members, owners)
			if len(c)+len(r) > 0 {
				plans = append(plans, plan{m, c, r})
			}
		}
		if len(plans) == 0 {
			return owners
		}
		snapshot := slices.Clone(owners)
		rng.Shuffle(len(plans), func(i, j int) { plans[i], plans[j] = plans[j], plans[i] })
		for _, pl := range plans {
			for _, p := range pl.release {
				owners[p] = ""
			}
		}
		for _, pl := range plans {
			for _, p := range pl.claim {
				if snapshot[p] == "" && owners[p] == "" {
					owners[p] = pl.m
				}
			}
		}
		for _, m := range members {
			if c, q := count(owners, m), election.Quota(len(owners), members, m); c > q && c > count(snapshot, m) {
				t.Fatalf("members %v: %s grew to %d partitions, above its quota %d", members, m, c, q)
			}
		}
	}
	t.Fatalf("members %v: no settled assignment after 10 rounds: %q", members, owners)
	return nil
}

func checkBalanced(t *testing.T, members, owners []string) {
	t.Helper()
	P, n := len(owners), len(members)
	total := 0
	for _, m := range members {
		c := count(owners, m)
		total += c
		if c < P/n || c > (P+n-1)/n {
			t.Fatalf("P=%d members %v: %s owns %d, want %d…%d (%q)", P, members, m, c, P/n, (P+n-1)/n, owners)
		}
	}
	if total != P {
		t.Fatalf("P=%d members %v own %d partitions between them, want all (%q)", P, members, total, owners)
	}
}

func count(owners []string, m string) int {
	n := 0
	for _, o := range owners {
		if o == m {
			n++
		}
	}
	return n
}

func sameSet(a, b []int) bool {
	return slices.Equal(slices.Sorted(slices.Values(a)), slices.Sorted(slices.Values(b)))
}

// randomIDs returns n distinct replica ids shaped like host names with random suffixes.
func randomIDs(rng *rand.Rand, n int) []string {
	seen := map[string]bool{}
	var ids []string
	for len(ids) < n {
		id := fmt.Sprintf("host-%d-%x", rng.IntN(50), rng.Uint32())
		if rng.IntN(3) == 0 {
			id = fmt.Sprintf("r%d", rng.IntN(20))
		}
		if !seen[id] {
			seen[id] = true
			ids = append(ids, id)
		}
	}
	return ids
}
