package election

import "strconv"

// rank returns the member that ranks first for partition p by rendezvous (highest-random-weight)
// hashing, or "" when members is empty. It depends only on p and the set of members (not their
// order or duplicates), so every replica that sees the same members computes the same owner, and
// adding or removing a member moves only the partitions that member ranks first for. It balances
// only on average, so the [Elector] does not assign by it: it assigns by [Quota] and [Plan],
// which order each replica's preferences by the same weights. rank is kept, and tested, as the
// statement of what those weights mean.
func rank(p int, members []string) string {
	var best string
	var bestW uint64
	for i, m := range members {
		w := weight(p, m)
		if i == 0 || w > bestW || (w == bestW && m < best) {
			best, bestW = m, w
		}
	}
	return best
}

// weight is the rendezvous weight of member m for partition p: FNV-1a 64 over the member name,
// the separator and the decimal partition, finished with the splitmix64 mixer so that names that
// differ only in their last bytes still get independent weights.
func weight(p int, m string) uint64 {
	const (
		offset64 = 14695981039346656037
		prime64  = 1099511628211
	)
	h := uint64(offset64)
	for i := 0; i < len(m); i++ {
		h ^= uint64(m[i])
		h *= prime64
	}
	h ^= '/'
	h *= prime64
	var buf [20]byte
	for _, c := range strconv.AppendInt(buf[:0], int64(p), 10) {
		h ^= uint64(c)
		h *= prime64
	}
	// splitmix64 finaliser.
	h ^= h >> 30
	h *= 0xbf58476d1ce4e5b9
	h ^= h >> 27
	h *= 0x94d049bb133111eb
	h ^= h >> 31
	return h
}
