package kv

import (
	"cmp"
	"errors"
	"fmt"
	"hash/maphash"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/internal/ratelog"
	"github.com/kvmapper/kvmapper/subjects"
)

// ErrInvalidConfig is wrapped by the error [New] returns for an unusable argument.
var ErrInvalidConfig = errors.New("kv: invalid config")

// ErrRunning is returned by [Table.Run] when the table is already running.
var ErrRunning = errors.New("kv: table already running")

// Config tunes a Table. Zero fields mean defaults.
type Config struct {
	Logger zerolog.Logger // default zerolog.Nop()
	// OnUpdate, if set, is called on the watch goroutine after each applied change (for
	// metrics); must not block.
	OnUpdate func(u Update)
	// RetryMin is the first wait before re-watching after the watch stopped or failed; it
	// doubles on each failure up to RetryMax. Defaults: 100ms and 5s.
	RetryMin time.Duration
	// RetryMax caps the wait between re-watch attempts. Default 5s.
	RetryMax time.Duration
	// CheckInterval is how often Run asks the server whether the bucket still exists and the
	// watcher keeps up with it; nats.go alone notices neither for 10–20 s. Default 1s.
	CheckInterval time.Duration
	// Schema says what the templates need of a device's value (subjects.Layout.Schema): each
	// value is decoded and checked against it once, when the table reads it. Default
	// subjects.GroupSchema: {group}, one subject token.
	Schema *subjects.Schema
}

// Update describes one change applied to a [Table], as passed to [Config.OnUpdate].
type Update struct {
	Device  string
	Entry   Entry
	Deleted bool // the device was removed (delete, purge, or gone from a re-watched bucket)
	Initial bool // the change belongs to a watch's initial values, not a live update
}

// Entry is what the table holds for one device: the value decoded by the table's schema, or why
// the templates cannot use it.
type Entry struct {
	// Values are the fields the templates use (see subjects.Schema); empty when Invalid.
	Values subjects.Values
	// Group is the field {group}, when the templates use it; "" when Invalid.
	Group    string
	Revision uint64 // KV revision of the value
	// Invalid is set when the templates cannot use the value; Reason, Field and Detail say why.
	Invalid bool
	// Reason is one of wire.ValueReasons: wire.ReasonInvalidGroup for a plain value that is not
	// one valid subject token, wire.ReasonInvalidValue, ReasonMissingField or ReasonInvalidField
	// for a JSON one.
	Reason string
	Field  string // the field at fault; "" when the value as a whole is
	Detail string // what is wrong, for people
}

// numShards must be a power of two. 256 locks keep 16 concurrent readers (and the one writer)
// mostly on different cache lines while costing only 16 KiB.
const numShards = 256

// slot is what a shard map stores per device: 16 bytes with no pointers. rec indexes
// Table.records, with invalidRec set when the record says why the value is unusable. gen is the
// watch generation that last wrote the slot, used to sweep devices that disappeared while the
// watch was down.
type slot struct {
	rev uint64
	rec uint32
	gen uint32
}

// invalidRec marks, in slot.rec, the index of a record of an unusable value.
const invalidRec = 1 << 31

// shortKey holds a device id of up to shortKeyMax bytes inline, its length in the last byte.
// Keeping ids inside the map slot saves a pointer chase (a second cache miss) per Lookup in a
// table far larger than the CPU caches, and leaves the GC nothing to scan in the map.
type shortKey [24]byte

const shortKeyMax = len(shortKey{}) - 1

func makeShortKey(device string) (k shortKey, ok bool) {
	if len(device) > shortKeyMax {
		return k, false
	}
	copy(k[:], device)
	k[shortKeyMax] = byte(len(device))
	return k, true
}

func (k *shortKey) String() string { return string(k[:k[shortKeyMax]]) }

type shard struct {
	mu    sync.RWMutex
	short map[shortKey]slot                             // ids of at most shortKeyMax bytes
	long  map[string]slot                               // longer ids
	_     [64 - unsafe.Sizeof(sync.RWMutex{}) - 16]byte // one shard per cache line
}

// get must be called with s.mu held.
func (s *shard) get(device string) (slot, bool) {
	if k, ok := makeShortKey(device); ok {
		v, ok := s.short[k]
		return v, ok
	}
	v, ok := s.long[device]
	return v, ok
}

// Table is an in-memory view of the device→group bucket, kept current by [Table.Run].
// Lookup, Len, Revision and Ready are safe for concurrent use.
//
// Storage is 256 shards, each a plain map guarded by its own RWMutex, rather than an immutable
// snapshot swapped whole: copying a million-key map per update is out of the question, and a
// per-shard lock gives readers the same guarantee (an entry is never seen half-applied, and
// readers get a copy, never a reference into the table) with zero allocations and little
// contention, since 16 readers rarely meet on one of 256 locks. Each entry is 16 bytes
// (revision, record index, watch generation) plus its key. The records are the decoded values
// (subjects.Values), or what is wrong with them, interned: devices with the same value share
// one, so that a fleet routed on a few groups, regions and tenants costs no more per device
// than one routed on a group alone. A record lives in a slice published through an atomic
// pointer, counted by the devices using it, and its index is reused once none does.
type Table struct {
	bucket     jetstream.KeyValue
	log        zerolog.Logger
	onUpdate   func(Update)
	retryMin   time.Duration
	retryMax   time.Duration
	checkEvery time.Duration

	seed   maphash.Seed
	shards [numShards]shard
	schema *subjects.Schema
	group  int // schema.Group()
	// records holds each record in its packed form (see record). The writer appends in place
	// (or into a fresh array) before publishing the longer header, so a reader never indexes
	// past the header it loaded; it writes an index again only once no slot refers to it, and
	// a reader reads a record under the lock of the shard whose slot gave it the index, so
	// that a reused index is never read for the record it held before.
	records atomic.Pointer[[]string]
	// invalid counts the devices with an unusable value, by reason (wire.ValueReasons order).
	invalid [4]atomic.Int64
	n       atomic.Int64
	rev     atomic.Uint64
	// watchRev is the highest revision the current watcher delivered, for the stall check.
	watchRev atomic.Uint64
	// loaded is the last completed load, nil before the first; CatchUp compares with it.
	loaded atomic.Pointer[loadMark]
	// wake is closed and cleared by the writer when rev or loaded advances; CatchUp creates it
	// when it has to wait. nil when nobody waits.
	wake atomic.Pointer[chan struct{}]

	ready     chan struct{}
	readyOnce sync.Once
	running   atomic.Bool

	// stalledAt is the stream revision behind the last stall re-watch. Owned by the check
	// goroutine; successive ones are ordered by the WaitGroup that waits for each.
	stalledAt uint64

	// Owned by the writer: the goroutine running Run.
	intern  map[string]uint32 // packed record → index
	refs    []uint32          // by record index: the slots referring to it
	free    []uint32          // record indexes no slot refers to
	scratch []byte            // the record being decoded
	gen     uint32
	warn    ratelog.Limiter // one warning a second about invalid values
}

// New returns a Table for bucket. It does no I/O: call [Table.Run] to load and watch the bucket.
func New(bucket jetstream.KeyValue, cfg Config) (*Table, error) {
	if bucket == nil {
		return nil, fmt.Errorf("%w: nil bucket", ErrInvalidConfig)
	}
	if cfg.RetryMin < 0 || cfg.RetryMax < 0 || cfg.CheckInterval < 0 {
		return nil, fmt.Errorf("%w: negative interval", ErrInvalidConfig)
	}
	return newTable(bucket, cfg), nil
}

func newTable(bucket jetstream.KeyValue, cfg Config) *Table {
	if cfg.RetryMin == 0 {
		cfg.RetryMin = 100 * time.Millisecond
	}
	if cfg.RetryMax == 0 {
		cfg.RetryMax = 5 * time.Second
	}
	if cfg.CheckInterval == 0 {
		cfg.CheckInterval = time.Second
	}
	if cfg.RetryMax < cfg.RetryMin {
		cfg.RetryMax = cfg.RetryMin
	}
	t := &Table{
		bucket:     bucket,
		log:        cfg.Logger,
		onUpdate:   cfg.OnUpdate,
		retryMin:   cfg.RetryMin,
		retryMax:   cfg.RetryMax,
		checkEvery: cfg.CheckInterval,
		seed:       maphash.MakeSeed(),
		schema:     cmp.Or(cfg.Schema, subjects.GroupSchema),
		ready:      make(chan struct{}),
		intern:     make(map[string]uint32),
	}
	for i := range t.shards {
		t.shards[i].short = make(map[shortKey]slot)
		t.shards[i].long = make(map[string]slot)
	}
	t.group = t.schema.Group()
	var records []string
	t.records.Store(&records)
	return t
}

// Ready returns a channel that Run closes, once, after the initial values have been loaded: the
// watcher's nil marker has arrived and the watch has caught up with the bucket. It stays closed
// across re-watches.
func (t *Table) Ready() <-chan struct{} { return t.ready }

// Lookup returns the device's entry; ok is false when the device has no key (never put, deleted
// or purged). A value the templates cannot use gives ok true with Invalid set.
// Safe for concurrent use; zero allocations.
func (t *Table) Lookup(device string) (e Entry, ok bool) {
	s := &t.shards[maphash.String(t.seed, device)&(numShards-1)]
	s.mu.RLock()
	v, ok := s.get(device)
	var rec string
	if ok {
		// Under the lock: the writer reuses an index only once no slot refers to it.
		rec = (*t.records.Load())[v.rec&^invalidRec]
	}
	s.mu.RUnlock()
	if !ok {
		return Entry{}, false
	}
	return t.entry(rec, v.rec&invalidRec != 0, v.rev), true
}

// Mapping is [Table.Lookup] as the lanes and direct mode take it, without the entry's group: the
// device's values and revision, or the reason, field and detail of its unusable value, or
// [wire.ReasonNoMapping] when the device has no key. Safe for concurrent use; zero allocations.
func (t *Table) Mapping(device string) subjects.Mapping {
	s := &t.shards[maphash.String(t.seed, device)&(numShards-1)]
	s.mu.RLock()
	v, ok := s.get(device)
	var rec string
	if ok {
		rec = (*t.records.Load())[v.rec&^invalidRec] // under the lock, as in Lookup
	}
	s.mu.RUnlock()
	switch {
	case !ok:
		return noMapping
	case v.rec&invalidRec != 0:
		return subjects.Faulted(rec[1:], v.rev)
	}
	return subjects.Mapping{Values: subjects.ValuesOf(rec), Revision: v.rev}
}

// Len returns the number of devices in the table, invalid ones included.
func (t *Table) Len() int { return int(t.n.Load()) }

// Revision returns the highest KV revision (stream sequence of the bucket) the table has applied,
// delete and purge markers included; the watcher applies revisions in stream order, so every
// earlier one is applied too. When the bucket was deleted and created again it goes back to the
// new bucket's revision once the table has reloaded it.
func (t *Table) Revision() uint64 { return t.rev.Load() }

func (t *Table) shard(device string) *shard {
	return &t.shards[maphash.String(t.seed, device)&(numShards-1)]
}

// put stores device's value, written at revision rev, and reports the stored entry.
func (t *Table) put(device string, value []byte, rev uint64) Entry {
	rec, e := t.record(value, rev)
	s := t.shard(device)
	s.mu.Lock()
	v := slot{rev: rev, rec: rec, gen: t.gen}
	var old slot
	var existed bool
	if k, ok := makeShortKey(device); ok {
		old, existed = s.short[k]
		s.short[k] = v
	} else {
		old, existed = s.long[device]
		// Cloned on every write: map assignment replaces a string key, and the watcher's key
		// is a substring of the whole message subject.
		s.long[strings.Clone(device)] = v
	}
	if !existed {
		// Counted under the shard's lock: a Lookup that sees the device sees it counted in Len.
		t.n.Add(1)
	}
	s.mu.Unlock()
	if existed {
		t.release(old.rec)
	}
	t.bumpRevision(rev)
	return e
}

// remove deletes device and reports whether it was present.
func (t *Table) remove(device string, rev uint64) bool {
	s := t.shard(device)
	s.mu.Lock()
	old, existed := s.get(device)
	if existed {
		if k, ok := makeShortKey(device); ok {
			delete(s.short, k)
		} else {
			delete(s.long, device)
		}
		t.n.Add(-1) // under the lock: a Lookup that no longer sees the device sees Len without it
	}
	s.mu.Unlock()
	if existed {
		t.release(old.rec)
	}
	t.bumpRevision(rev)
	return existed
}

// sweep removes every device not written by the current watch generation: those deleted while
// the watch was down with their markers gone, or all of them if the bucket was recreated.
func (t *Table) sweep() int {
	var gone []string
	var recs []uint32
	total := 0
	for i := range t.shards {
		s := &t.shards[i]
		gone, recs = gone[:0], recs[:0]
		s.mu.Lock()
		for k, v := range s.short {
			if v.gen != t.gen {
				delete(s.short, k)
				gone, recs = append(gone, k.String()), append(recs, v.rec)
			}
		}
		for k, v := range s.long {
			if v.gen != t.gen {
				delete(s.long, k)
				gone, recs = append(gone, k), append(recs, v.rec)
			}
		}
		t.n.Add(-int64(len(gone)))
		s.mu.Unlock()
		for _, r := range recs {
			t.release(r)
		}
		total += len(gone)
		if t.onUpdate != nil {
			for _, k := range gone {
				t.onUpdate(Update{Device: k, Deleted: true, Initial: true})
			}
		}
	}
	return total
}

// presize gives the empty shard maps room for about n devices, so that the first load does not
// rehash each map a dozen times as it grows. Only the writer calls it, before the first watch.
func (t *Table) presize(n uint64) {
	const maxHint = 1 << 26
	per := int(min(n, maxHint)/numShards + 1)
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		if len(s.short) == 0 {
			s.short = make(map[shortKey]slot, per)
		}
		s.mu.Unlock()
	}
}

func (t *Table) bumpRevision(rev uint64) {
	if rev > t.rev.Load() {
		t.rev.Store(rev) // single writer
		t.advanced()
	}
}

func (t *Table) markReady() { t.readyOnce.Do(func() { close(t.ready) }) }
