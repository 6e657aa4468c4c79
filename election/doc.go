// Package election shares a fixed set of partitions among the replicas of a service through
// leases held in a JetStream KV bucket: members heartbeat member.<id> keys with a per-key TTL,
// owners hold lease.<p> keys with a per-key TTL and renew them with revision checks, every
// replica computes the same quota for each live member (the partitions split as evenly as they
// can be) and keeps what it owns within its quota, claims free partitions up to it and hands the
// excess over, so that members coming and going move as few partitions as possible, and an owner whose renewals fail fences itself on its own
// lease clock (one that counts suspend) before the server can give its lease to someone else. It tells its caller
// "partition p is yours, under this context" by calling a [Work] func and "release p" by
// cancelling that context; it knows nothing of messages, checkpoints or what the work does.
package election
