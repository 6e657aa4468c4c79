// Package kv watches the device→value KV bucket (by default "device-groups": key = device id,
// value = group id, or a JSON object of fields) into an in-memory [Table] whose [Table.Mapping] is
// the mapper's per-message hot path. It decodes each value once, with the templates' schema
// (subjects.Schema), into a record shared by the devices with the same value, and keeps what is
// wrong with a value the templates cannot use (reasons "invalid-group", "invalid-value",
// "missing-field", "invalid-field"); survives server restarts and a deleted or re-created bucket by
// watching again while it keeps serving the last table; and with [Table.CatchUp] lets a
// partition's new owner wait until its table holds everything the bucket held when it claimed, so
// that it never maps with an older value than the previous owner did (I4). Deciding what a missing
// or invalid mapping means for a message, and connecting to NATS, are left to the caller.
package kv
