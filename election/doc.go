// Package election shares a fixed set of partitions among the replicas of a service through
// leases held in a JetStream KV bucket. Members heartbeat member.<id> keys and owners hold
// lease.<p> keys, both with per-key TTLs; every replica computes the same quota for each live
// member (the partitions split as evenly as they can be), keeps what it owns within its quota,
// claims free partitions up to it and hands the excess over, so that members coming and going
// move as few partitions as possible. An owner whose renewals fail stops on its own lease clock,
// which counts time the machine was suspended, before the server can give the lease to another.
// It tells its caller "partition p is yours, under this context" by calling a [Work] func and
// "release p" by cancelling that context; it knows nothing of messages, checkpoints or what the
// work does.
package election
