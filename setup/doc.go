// Package setup creates or verifies the streams and buckets kvmapper runs on: INCOMING with the
// partitioning subject transform (or, in the streams layout, one stream per partition, after
// probing that the server's account mapping fills them), OUTGOING with a duplicate window above
// the worst takeover, UNMAPPED for dead letters, the groups bucket and the control bucket with
// limit markers. In direct mode it creates no INCOMING: it checks that no stream captures the
// device subjects and probes that the server maps them as the replicas receive them. It chooses
// the stream layout of a new deployment (ChooseLayout: the partition streams when the server's
// account mapping is active) and records it in the control bucket, where every other command
// reads it (RecordedLayout). It never changes an existing stream or bucket: where one differs from what
// kvmapper needs it returns an error naming the difference and the fix. It leaves running to the
// other packages.
package setup
