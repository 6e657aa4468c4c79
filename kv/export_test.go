package kv

import "github.com/kvmapper/kvmapper/subjects"

// NewUnbound returns a Table without a bucket, for benchmarks that fill it with PutForTest.
func NewUnbound(cfg Config) *Table { return newTable(nil, cfg) }

// PutForTest stores device → value as the watcher would, without a server.
func (t *Table) PutForTest(device, value string, rev uint64) {
	t.put(device, trimNewlines([]byte(value)), rev)
}

// DeleteForTest removes device as the watcher would, without a server.
func (t *Table) DeleteForTest(device string, rev uint64) { t.remove(device, rev) }

// RecordsForTest returns the number of records the table holds and how many of their indexes
// are free for reuse.
func (t *Table) RecordsForTest() (records, free int) { return len(*t.records.Load()), len(t.free) }

var (
	ValidGroup   = subjects.IsValidToken
	TrimNewlines = trimNewlines
)
