package election

import (
	"cmp"
	"slices"
)

// Quota returns how many of partitions replica me should own while members are live: with n
// distinct members sorted by id, the first partitions mod n have ⌈partitions/n⌉ and the rest
// ⌊partitions/n⌋, so the quotas sum to partitions and differ by at most one. me counts as a
// member even when members lacks it. It depends only on the set of members, so every replica
// that sees the same members computes the same quotas. It is a pure function, safe for
// concurrent use.
func Quota(partitions int, members []string, me string) int {
	ms := append(slices.Clone(members), me)
	slices.Sort(ms)
	ms = slices.Compact(ms)
	i, _ := slices.BinarySearch(ms, me)
	q := partitions / len(ms)
	if i < partitions%len(ms) {
		q++
	}
	return q
}

// Plan returns what replica me should do to move the ownership in owners towards every live
// member owning its [Quota] while moving as few partitions as possible. owners[p] is the replica
// holding partition p's lease, or "" when p is free; len(owners) is the number of partitions.
// members are the live replicas; me counts as one even when members lacks it. Partitions held by
// replicas not in members count as owned, not free: their leases expire on their own.
//
// Within quota both lists are empty: a replica keeps what it owns, so a balanced assignment is
// a fixed point. Under quota, claim lists the free partitions to claim, as many as are missing
// (or all free ones), highest rendezvous weight for me first, so that replicas racing for free
// partitions mostly want different ones. Over quota, release lists the excess of the owned
// partitions, lowest weight for me first. Because the quotas sum to the number of partitions,
// the other live members then lack at least that excess on top of the free partitions and those
// of departed owners: a released partition always has a live member under quota to take it.
//
// From a balanced assignment, a member joining moves exactly its own quota of partitions, all
// to it, and a member leaving moves only its partitions, all to the survivors: no survivor's
// quota shrinks when a member leaves or grows when one joins. It is a pure function, safe for
// concurrent use.
func Plan(me string, members, owners []string) (claim, release []int) {
	want := Quota(len(owners), members, me)
	var free, mine []int
	for p, o := range owners {
		switch o {
		case "":
			free = append(free, p)
		case me:
			mine = append(mine, p)
		}
	}
	switch {
	case len(mine) < want:
		byWeight(free, me, true)
		claim = free[:min(len(free), want-len(mine))]
	case len(mine) > want:
		byWeight(mine, me, false)
		release = mine[:len(mine)-want]
	}
	return claim, release
}

// byWeight sorts ps by me's rendezvous weight, highest first when desc, breaking ties by
// partition number.
func byWeight(ps []int, me string, desc bool) {
	slices.SortFunc(ps, func(a, b int) int {
		c := cmp.Compare(weight(a, me), weight(b, me))
		if desc {
			c = -c
		}
		return cmp.Or(c, cmp.Compare(a, b))
	})
}
