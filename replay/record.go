package replay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/kvcas"
)

// record is a replay's progress, stored as JSON under [wire.ReplayKey] in the control bucket. It holds
// what the replay resolved when it first started (the ranges, the as-of revision), so that a
// resumed replay publishes exactly what the first run would have, and how far it got.
type record struct {
	// Spec is the description of the replay a default id is derived from; Shape is Spec without
	// the range and the as-of point, which a run resuming the replay must share.
	Spec    string   `json:"spec"`
	Shape   string   `json:"shape"`
	AsOf    uint64   `json:"as_of"`
	Dead    string   `json:"dead_letters"` // the stream dead letters go to
	Sources []source `json:"sources"`
	// Floors holds, for each stream the replay publishes to, a sequence after which that stream
	// stored (if at all) every message the replay sent that no source's Done covers yet: a
	// resumed replay reads the stream's messages after it to find what it need not send again.
	Floors   map[string]uint64 `json:"floors"`
	Complete bool              `json:"complete"`
	Started  time.Time         `json:"started"`
	Updated  time.Time         `json:"updated"`
}

// store is the replay's record in the control bucket and its revision, for compare-and-set.
type store struct {
	kv  jetstream.KeyValue
	key string
	rev uint64
}

// load reads the record; ok is false when there is none.
func (s *store) load(ctx context.Context) (rec record, ok bool, err error) {
	e, err := s.kv.Get(ctx, s.key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return rec, false, nil
	}
	if err != nil {
		return rec, false, fmt.Errorf("replay: reading %s: %w", s.key, err)
	}
	if err := json.Unmarshal(e.Value(), &rec); err != nil {
		return rec, false, fmt.Errorf("replay: %s holds no replay record: %w", s.key, err)
	}
	s.rev = e.Revision()
	return rec, true, nil
}

// save writes rec over the revision last read or written; a record written meanwhile by anyone
// else is an error wrapping [ErrConflict].
func (s *store) save(ctx context.Context, rec *record) error {
	rec.Updated = time.Now().UTC()
	v, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	var rev uint64
	if s.rev == 0 {
		rev, err = s.kv.Create(ctx, s.key, v)
	} else {
		rev, err = s.kv.Update(ctx, s.key, v, s.rev)
	}
	if kvcas.IsConflict(err) {
		return fmt.Errorf("%w: %s was written by another run of this replay (is one still running?)", ErrConflict, s.key)
	}
	if err != nil {
		return fmt.Errorf("replay: writing %s: %w", s.key, err)
	}
	s.rev = rev
	return nil
}
