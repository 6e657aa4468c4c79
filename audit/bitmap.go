package audit

import (
	"math/bits"
	"sync/atomic"
)

// bitmap is a fixed-size set of small integers, one bit each, safe for concurrent set and get.
type bitmap []atomic.Uint64

func newBitmap(n uint64) bitmap { return make(bitmap, (n+63)/64) }

// set adds i and reports whether it was already there.
func (b bitmap) set(i uint64) bool {
	m := uint64(1) << (i & 63)
	return b[i>>6].Or(m)&m != 0
}

func (b bitmap) get(i uint64) bool { return b[i>>6].Load()&(1<<(i&63)) != 0 }

// count returns the number of members.
func (b bitmap) count() uint64 {
	var n int
	for i := range b {
		n += bits.OnesCount64(b[i].Load())
	}
	return uint64(n)
}

// countAndNot returns the number of members of b that are not in d, which has b's size.
func (b bitmap) countAndNot(d bitmap) uint64 {
	var n int
	for i := range b {
		n += bits.OnesCount64(b[i].Load() &^ d[i].Load())
	}
	return uint64(n)
}

// nextClear returns the first i' >= i below n that is not a member, or n.
func (b bitmap) nextClear(i, n uint64) uint64 {
	for i < n {
		w := ^b[i>>6].Load() >> (i & 63)
		if w != 0 {
			i += uint64(bits.TrailingZeros64(w))
			return min(i, n)
		}
		i = (i | 63) + 1
	}
	return n
}
