// Package kv watches the device→group KV bucket (by default "device-groups": key = device id,
// value = group id) into an in-memory [Table] whose [Table.Lookup] is the mapper's per-message hot
// path. It validates group values (one valid subject token, else reason "invalid-group"),
// survives server restarts and a deleted or re-created bucket by watching again while it keeps
// serving the last table, and with [Table.CatchUp] lets a partition's new owner wait until its
// table holds everything the bucket held when it claimed, so that it never maps with an older
// value than the previous owner did (I4). Deciding what a missing or invalid mapping means for a
// message, and connecting to NATS, are left to the caller.
package kv
