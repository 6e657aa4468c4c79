package kv

import "github.com/kvmapper/kvmapper/subjects"

// NewUnbound returns a Table without a bucket, for benchmarks that fill it with PutForTest.
func NewUnbound(cfg Config) *Table { return newTable(nil, cfg) }

// PutForTest stores device → group as the watcher would, without a server.
func (t *Table) PutForTest(device, group string, rev uint64) {
	v := trimNewlines([]byte(group))
	t.put(device, v, subjects.IsValidToken(string(v)), rev)
}

var (
	ValidGroup   = subjects.IsValidToken
	TrimNewlines = trimNewlines
)
