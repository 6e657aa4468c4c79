package status

import (
	"context"
	"encoding/json"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"
)

// DefaultEventsSubject is the subject ownership events are published on by default.
const DefaultEventsSubject = "kvmapper.events.ownership"

// Event is one ownership change of a partition, published by the replica it concerns: the new
// owner publishes its claim, the old owner its release. A replica killed outright publishes
// nothing; the claim of its successor names it as OldOwner.
type Event struct {
	Partition int    `json:"partition"`
	OldOwner  string `json:"old_owner"` // "" when no owner was seen before
	NewOwner  string `json:"new_owner"` // "" when the lease was released or expired
	Epoch     uint64 `json:"epoch"`     // lease revision of NewOwner's claim; 0 when NewOwner is ""
	// ResumeSeq is checkpoint.<p> when the event was published: for a claim, the INCOMING
	// sequence the new owner resumes after; for a release, the final checkpoint. 0 when unknown.
	ResumeSeq    uint64    `json:"resume_seq"`
	UnownedGapMS int64     `json:"unowned_gap_ms"` // how long the partition had no owner before the claim
	At           time.Time `json:"at"`             // when the replica observed the change
	Replica      string    `json:"replica"`        // the replica that published the event
}

// EventsConfig tunes [Events]. Zero fields mean the defaults given.
type EventsConfig struct {
	// Subject is where events are published. Required.
	Subject string
	// Replica is the publishing replica's id, stamped on every event.
	Replica string
	// Buffer is how many events may wait for publication; beyond it [Events.Offer] drops.
	// Default 1024.
	Buffer int
	// ResumeSeq, if set, is called before publishing an event to fill in Event.ResumeSeq;
	// an error leaves it 0.
	ResumeSeq func(ctx context.Context, partition int) (uint64, error)
	// Logger receives one line per event published or dropped. Default: none.
	Logger zerolog.Logger
}

// Events publishes ownership events on core NATS from its own goroutine, so that the code that
// observes a change never waits for the network. It is safe for concurrent use.
type Events struct {
	nc        *nats.Conn
	cfg       EventsConfig
	queue     chan Event
	published atomic.Uint64
	dropped   atomic.Uint64
}

// NewEvents returns a publisher on nc. It does no I/O; run it with [Events.Run].
func NewEvents(nc *nats.Conn, cfg EventsConfig) (*Events, error) {
	if nc == nil {
		return nil, fmt.Errorf("%w: nil connection", ErrInvalidConfig)
	}
	if cfg.Subject == "" {
		return nil, fmt.Errorf("%w: events subject is required", ErrInvalidConfig)
	}
	if cfg.Buffer == 0 {
		cfg.Buffer = 1024
	}
	if cfg.Buffer < 0 {
		return nil, fmt.Errorf("%w: negative buffer %d", ErrInvalidConfig, cfg.Buffer)
	}
	return &Events{nc: nc, cfg: cfg, queue: make(chan Event, cfg.Buffer)}, nil
}

// Offer queues ev for publication without blocking. It reports false, and counts the event as
// dropped, when the queue is full.
func (e *Events) Offer(ev Event) bool {
	select {
	case e.queue <- ev:
		return true
	default:
		e.dropped.Add(1)
		e.cfg.Logger.Warn().Int("partition", ev.Partition).Str("old_owner", ev.OldOwner).Str("new_owner", ev.NewOwner).
			Msg("ownership event dropped: publisher behind")
		return false
	}
}

// Published returns how many events have been published.
func (e *Events) Published() uint64 { return e.published.Load() }

// Dropped returns how many events [Events.Offer] has dropped.
func (e *Events) Dropped() uint64 { return e.dropped.Load() }

// Run publishes queued events until ctx is done, then publishes those still queued, flushes
// the connection (up to 2s) and returns nil. Events offered after Run returned stay queued.
func (e *Events) Run(ctx context.Context) error {
	for {
		select {
		case ev := <-e.queue:
			e.publish(ctx, ev)
		case <-ctx.Done():
			// Releases are observed while the replica stops: send what is queued.
			fctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			for {
				select {
				case ev := <-e.queue:
					e.publish(fctx, ev)
				default:
					_ = e.nc.FlushWithContext(fctx)
					return nil
				}
			}
		}
	}
}

func (e *Events) publish(ctx context.Context, ev Event) {
	ev.Replica = e.cfg.Replica
	if e.cfg.ResumeSeq != nil && ctx.Err() == nil {
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		seq, err := e.cfg.ResumeSeq(rctx, ev.Partition)
		cancel()
		if err == nil {
			ev.ResumeSeq = seq
		}
	}
	b, err := json.Marshal(ev)
	if err == nil {
		err = e.nc.Publish(e.cfg.Subject, b)
	}
	log := e.cfg.Logger.Debug()
	if err != nil {
		log = e.cfg.Logger.Warn().Err(err)
	} else {
		e.published.Add(1)
	}
	log.Str("subject", e.cfg.Subject).Int("partition", ev.Partition).Str("old_owner", ev.OldOwner).
		Str("new_owner", ev.NewOwner).Uint64("epoch", ev.Epoch).Uint64("resume_seq", ev.ResumeSeq).
		Int64("unowned_gap_ms", ev.UnownedGapMS).Msg("ownership event")
}
