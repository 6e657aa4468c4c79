package subjects

// FNV-1a 32-bit parameters (hash/fnv); inlined so that Partition neither allocates nor converts key
// to a []byte.
const (
	fnvOffset32 = 2166136261
	fnvPrime32  = 16777619
)

// Partition returns the partition of key among n partitions: FNV-1a 32-bit over the bytes of key,
// modulo n. It is identical to nats-server's {{partition(n,i)}} subject transform for one token
// (getHashPartition in the server's subject_transform.go); for several tokens the server hashes
// them concatenated with no separator, so pass that concatenation. Like the server it returns 0 when
// n < 1. It does not allocate and is safe for concurrent use.
func Partition(key string, n int) int {
	if n < 1 {
		return 0
	}
	h := uint32(fnvOffset32)
	for i := 0; i < len(key); i++ {
		h ^= uint32(key[i])
		h *= fnvPrime32
	}
	return int(h % uint32(n))
}
