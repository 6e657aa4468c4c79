package direct

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

var (
	// ErrInvalidConfig is wrapped by the errors of [New] and [Pool.Run] for a configuration or an
	// argument they cannot run with.
	ErrInvalidConfig = errors.New("direct: invalid config")
	// ErrFenced is returned by [Pool.Run] when the partition's lease clock ran out, or a newer owner
	// announced itself: this replica must not forward that partition any more. A caller whose
	// lease is lost cancels the partition's context with a cause wrapping ErrFenced: the partition
	// then stops at once, without handing anything over, and Run returns nil. Any other cause (a
	// release, a shutdown) hands the partition over to its next owner.
	ErrFenced = errors.New("direct: partition fenced by a newer owner")
	// ErrClosed is returned by [Pool.Run] after [Pool.Close].
	ErrClosed = errors.New("direct: pool closed")
)

// LookupFunc returns what device maps with: the values of its KV value that the layout's
// templates render (decoded with Config.Layout's schema) and that value's revision, or a reason
// (the UNMAPPED reasons of the caller: no mapping, a value the templates cannot use) when the
// device cannot be mapped. It is called once per message from every partition at once: it must
// be safe for concurrent use and must not block.
type LookupFunc func(device string) subjects.Mapping

// Assignment is one partition handed to [Pool.Run] by its owner.
type Assignment struct {
	Partition int
	// Epoch is the owner's fencing token (the lease revision). It is stamped on every message,
	// and a newer owner announces its own, higher, epoch to take the partition over.
	Epoch uint64
	// Valid reports whether the lease still holds by the owner's own clock. The partition stops
	// forwarding as soon as it turns false. nil means the lease never runs out.
	Valid func() bool
}

// Config tunes a [Pool]. Zero fields mean the defaults given.
type Config struct {
	// Layout gives the subject templates and the partition count. Required.
	Layout *subjects.Layout
	// Receive says how partitions are received. Default [wire.ReceiveMapping].
	Receive wire.Receive
	// Replica names this replica in handoff announcements and logs.
	Replica string
	// HandoffPrefix is the subject prefix of the handoff announcements: a new owner of partition p
	// announces itself on <HandoffPrefix>.<p>. Every replica of one deployment must use the same.
	// Default "kvmapper.direct.kvmapper".
	HandoffPrefix string
	// HandoffTimeout is how long a released partition keeps forwarding while no new owner has
	// announced itself; after it the partition stops, and its messages get no acknowledgement
	// until an owner subscribes. Default 5s.
	HandoffTimeout time.Duration
	// AnswerTimeout is how long a new owner waits for the previous owner's answer to its
	// announcement before it serves on its own. Default 2s.
	AnswerTimeout time.Duration
	// HandoffSettle is how long an old owner goes on forwarding (and recording) after its handoff
	// marker has come back, before it unsubscribes: a message the server matched against the
	// subscriptions just before the new owner's existed may reach the old owner that late (its
	// publisher's goroutine in the server was descheduled in between). The new owner holds what
	// it receives meanwhile: a handoff delays the partition's PubAcks by about this. Default 50ms.
	HandoffSettle time.Duration
	// MaxRecorded bounds the reply subjects a released partition remembers for its next owner.
	// Past it the partition stops forwarding and waits for the announcement. Default 1<<20.
	MaxRecorded int
	// QueueMessages and QueueBytes bound what waits in a partition's queue, between the
	// connection and the partition's goroutine (subject, reply and payload are counted, and 64
	// bytes per header). A message that finds the queue full is dropped, counted and logged: its
	// publisher gets no acknowledgement and must retry. A new owner's queue holds what arrives
	// while it waits for the previous owner's answer. QueueBytes is raised to the connection's
	// maximum payload plus 8 KiB when lower. Defaults 16384 and 4 MiB.
	QueueMessages int
	QueueBytes    int64
	// Revision, if set, returns the highest KV revision the groups table has applied; CatchUp, if
	// set, blocks until the table has applied everything the groups bucket holds now. A new owner
	// taking over from a previous owner that had applied a later revision than its own table
	// calls CatchUp before forwarding anything, so that a group change the previous owner mapped
	// with is never undone (I4).
	Revision func() uint64
	CatchUp  func(ctx context.Context) error
	// Alone, if set, reports whether no other replica could take a released partition over (the
	// last replica is stopping): the partition then stops at once instead of waiting up to
	// HandoffTimeout for an announcement that will not come.
	Alone func(ctx context.Context) bool
	// LeaseCheck bounds the time a partition forwards between two readings of its lease clock,
	// besides every 64 messages: a batch of the queue is forwarded in one go, and an owner stopped
	// in its middle (SIGSTOP, a long pause) and resumed after its lease ran out reads the clock
	// again before its next message, not 63 messages later. Default 50ms.
	LeaseCheck time.Duration
	// Provenance adds the KVMapper-Prov header (partition, epoch, revision) to what is forwarded.
	// They are off by default: they make every stored message larger, which costs about a third
	// of the throughput (BenchmarkPipeline), and can make OUTGOING refuse a message within a
	// hundred bytes of its max_msg_size that it would have stored as the device sent it, changing
	// the device's PubAck. A message they would push past the connection's maximum payload is
	// forwarded without them.
	Provenance bool
	// Logger receives structured logs. Default: none.
	Logger zerolog.Logger
}

func (c *Config) setDefaults() error {
	if c.Layout == nil {
		return fmt.Errorf("%w: Layout is required", ErrInvalidConfig)
	}
	r, err := wire.ParseReceive(string(c.Receive))
	if err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	c.Receive = r
	if c.HandoffPrefix == "" {
		c.HandoffPrefix = "kvmapper.direct." + subjects.DefaultNames.Control
	}
	if c.HandoffTimeout == 0 {
		c.HandoffTimeout = 5 * time.Second
	}
	if c.AnswerTimeout == 0 {
		c.AnswerTimeout = 2 * time.Second
	}
	if c.HandoffSettle == 0 {
		c.HandoffSettle = 50 * time.Millisecond
	}
	if c.MaxRecorded == 0 {
		c.MaxRecorded = 1 << 20
	}
	if c.LeaseCheck == 0 {
		c.LeaseCheck = 50 * time.Millisecond
	}
	if c.QueueMessages == 0 {
		c.QueueMessages = 16384
	}
	if c.QueueBytes == 0 {
		c.QueueBytes = 4 << 20
	}
	switch {
	case c.HandoffTimeout < 0, c.AnswerTimeout < 0, c.HandoffSettle < 0, c.LeaseCheck < 0:
		return fmt.Errorf("%w: durations must be positive", ErrInvalidConfig)
	case c.MaxRecorded < 0, c.QueueMessages < 0, c.QueueBytes < 0:
		return fmt.Errorf("%w: MaxRecorded, QueueMessages and QueueBytes must be positive", ErrInvalidConfig)
	case (c.Revision == nil) != (c.CatchUp == nil):
		return fmt.Errorf("%w: Revision and CatchUp go together", ErrInvalidConfig)
	}
	for _, tok := range splitSubject(c.HandoffPrefix) {
		if subjects.ValidToken(tok) != nil {
			return fmt.Errorf("%w: handoff prefix %q is not a subject without wildcards", ErrInvalidConfig, c.HandoffPrefix)
		}
	}
	return nil
}
