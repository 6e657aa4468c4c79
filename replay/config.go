package replay

import (
	"errors"
	"fmt"
	"regexp"
	"slices"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/subjects"
)

var (
	// ErrInvalidConfig is wrapped by errors from [New] for a configuration it cannot run with.
	ErrInvalidConfig = errors.New("replay: invalid config")
	// ErrTarget is wrapped by [Replay.Run]'s error when the stream to replay into cannot take the
	// replay: it does not exist (and Create is off), does not capture the replay's subjects, is
	// one of kvmapper's own streams, or is OUTGOING without IntoOutgoing.
	ErrTarget = errors.New("replay: cannot replay into this stream")
	// ErrHistoryIncomplete is wrapped by [Replay.Run]'s error when the groups bucket no longer
	// holds the value some device had at the revision asked for, and AllowMissingHistory is off.
	ErrHistoryIncomplete = errors.New("replay: the groups bucket's history is shorter than asked")
	// ErrConflict is wrapped by [Replay.Run]'s error when the replay's progress record was
	// written by someone else: another process runs the same replay, or its id was used for
	// another replay.
	ErrConflict = errors.New("replay: the progress record belongs to another run")
	// ErrRecreated is wrapped by [Replay.Run]'s error when a stream the replay reads was deleted
	// and created again since the replay started: its sequences mean something else now.
	ErrRecreated = errors.New("replay: INCOMING was re-created since the replay started")
)

// ReasonHistoryMissing is the dead-letter reason of a message whose device's group at the
// as-of revision is gone from the groups bucket's history (see Config.AllowMissingHistory).
const ReasonHistoryMissing = "history-missing"

// AsOf says which groups table a replay maps with. The zero value is the table now: the bucket's
// last revision when the replay first starts (a resumed replay keeps it). Set Revision, or Time
// for the last revision written at or before it.
type AsOf struct {
	Revision uint64
	Time     time.Time
}

// Config describes one replay. Zero fields mean the defaults given.
type Config struct {
	// Layout gives the in template and partition count of INCOMING, and the replay's own
	// templates: Out for mapped messages, Unmapped for its dead letters. Required.
	Layout *subjects.Layout
	// Names are the deployment's streams and buckets, and how INCOMING is stored.
	Names subjects.Names
	// Into is the stream mapped messages go to. Required. It must capture Layout.Out's subjects.
	// OUTGOING only with IntoOutgoing; never INCOMING, UNMAPPED or a bucket's stream.
	Into string
	// IntoOutgoing confirms that Into may be the live mapper's OUTGOING stream: its consumers
	// then receive the replayed messages besides the live ones (under other Nats-Msg-Ids).
	IntoOutgoing bool
	// Create creates Into when it does not exist, capturing Layout.Out's and, unless another
	// stream captures them, Layout.Unmapped's subjects (their literal prefixes followed by ">"),
	// with Replicas replicas and a DuplicateWindow (default 2m).
	Create          bool
	Replicas        int
	DuplicateWindow time.Duration

	// ID names the replay: its progress record is replay.<ID> in the control bucket and its
	// Nats-Msg-Ids start with "replay:<ID>:". Letters, digits, '-' and '_', at most 64. Default:
	// derived from everything that decides what the replay publishes (streams and their
	// incarnations, range, partitions, devices, templates, Into, AsOf as given), so that running
	// the same replay again resumes it. A range or as-of time given relative to now (as the
	// command line allows) names another replay each time: resume such a replay by its ID, with
	// the range and revision it resolved when it started.
	ID string

	// The range, inclusive: FromSeq or FromTime (the first message stored at or after it), and
	// ToSeq or ToTime (the last message stored before it); without an end, the streams' last
	// messages when the replay first starts. Sequences are those of one stream: with the
	// PartitionStreams layout they need exactly one partition in Partitions. Times apply to
	// every stream read. Required: a start.
	FromSeq, ToSeq      uint64
	FromTime, ToTime    time.Time
	Partitions          []int    // only these partitions; default all
	Devices             []string // only these devices; default all
	AsOf                AsOf
	AllowMissingHistory bool // dead-letter (ReasonHistoryMissing) instead of refusing

	// DryRun reads and maps the range without publishing or recording anything; Summary counts
	// what would have gone where.
	DryRun bool

	// MaxInFlight bounds the unacknowledged publishes. Default 1024.
	MaxInFlight int
	// MaxRate bounds the messages read per second; 0 means no bound.
	MaxRate float64
	// PublishTimeout is how long a publish waits for its acknowledgement. Default 5s.
	PublishTimeout time.Duration
	// SaveInterval is how often progress is written to replay.<ID>. Default 250ms.
	SaveInterval time.Duration
	// ReportInterval is how often Progress is called. Default 1s.
	ReportInterval time.Duration
	// RetryBackoff is the first pause before republishing after a failure; it doubles up to
	// MaxRetryBackoff. Defaults 50ms and 2s.
	RetryBackoff, MaxRetryBackoff time.Duration
	// IdleCheck is how long a read waits for the next message before it checks whether any is
	// left in its range (some may have been removed while it read). Default 1s.
	IdleCheck time.Duration
	// Progress, if set, is called every ReportInterval and once at the end, on Run's goroutine;
	// it must not block for long.
	Progress func(Progress)
	// NoProvenance turns off the KVMapper-Prov (partition, revision) and KVMapper-Replay headers.
	NoProvenance bool
	// Logger receives structured logs. Default: none.
	Logger zerolog.Logger
}

// Validate checks c as [New] does, without connecting to anything.
func (c Config) Validate() error { return c.setDefaults() }

var idRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

func (c *Config) setDefaults() error {
	if c.Layout == nil {
		return fmt.Errorf("%w: Layout is required", ErrInvalidConfig)
	}
	c.Names = c.Names.WithDefaults()
	if c.Into == "" {
		return fmt.Errorf("%w: the stream to replay into is required", ErrInvalidConfig)
	}
	if c.ID != "" && !idRE.MatchString(c.ID) {
		return fmt.Errorf("%w: id %q: use letters, digits, '-' and '_', at most 64", ErrInvalidConfig, c.ID)
	}
	switch {
	case c.FromSeq == 0 && c.FromTime.IsZero():
		return fmt.Errorf("%w: a start is required: a sequence or a time", ErrInvalidConfig)
	case c.FromSeq > 0 && !c.FromTime.IsZero():
		return fmt.Errorf("%w: give the start as a sequence or as a time, not both", ErrInvalidConfig)
	case c.ToSeq > 0 && !c.ToTime.IsZero():
		return fmt.Errorf("%w: give the end as a sequence or as a time, not both", ErrInvalidConfig)
	case c.ToSeq > 0 && c.ToSeq < c.FromSeq:
		return fmt.Errorf("%w: the end sequence %d is before the start %d", ErrInvalidConfig, c.ToSeq, c.FromSeq)
	case !c.ToTime.IsZero() && !c.FromTime.IsZero() && !c.ToTime.After(c.FromTime):
		return fmt.Errorf("%w: the end time %v is not after the start %v", ErrInvalidConfig, c.ToTime, c.FromTime)
	case c.AsOf.Revision > 0 && !c.AsOf.Time.IsZero():
		return fmt.Errorf("%w: give as-of as a revision or as a time, not both", ErrInvalidConfig)
	}
	for _, p := range c.Partitions {
		if p < 0 || p >= c.Layout.Partitions {
			return fmt.Errorf("%w: partition %d outside 0..%d", ErrInvalidConfig, p, c.Layout.Partitions-1)
		}
	}
	c.Partitions = slices.Compact(slices.Sorted(slices.Values(c.Partitions)))
	c.Devices = slices.Compact(slices.Sorted(slices.Values(c.Devices)))
	for _, d := range c.Devices {
		if !subjects.IsValidToken(d) {
			return fmt.Errorf("%w: device %q is not a valid subject token", ErrInvalidConfig, d)
		}
	}
	seqs := c.FromSeq > 0 || c.ToSeq > 0
	if seqs && c.Names.StreamLayout == subjects.PartitionStreams && len(c.Partitions) != 1 {
		return fmt.Errorf("%w: with one stream per partition a sequence names a message of one stream: give one partition (or a time range, which applies to every partition's stream)", ErrInvalidConfig)
	}
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	if c.DuplicateWindow == 0 {
		c.DuplicateWindow = 2 * time.Minute
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = 1024
	}
	if c.PublishTimeout == 0 {
		c.PublishTimeout = 5 * time.Second
	}
	if c.SaveInterval == 0 {
		c.SaveInterval = 250 * time.Millisecond
	}
	if c.ReportInterval == 0 {
		c.ReportInterval = time.Second
	}
	if c.RetryBackoff == 0 {
		c.RetryBackoff = 50 * time.Millisecond
	}
	if c.MaxRetryBackoff == 0 {
		c.MaxRetryBackoff = 2 * time.Second
	}
	if c.IdleCheck == 0 {
		c.IdleCheck = time.Second
	}
	switch {
	case c.MaxInFlight < 1 || c.MaxInFlight > 50000:
		return fmt.Errorf("%w: MaxInFlight %d: use 1 to 50000", ErrInvalidConfig, c.MaxInFlight)
	case c.MaxRate < 0:
		return fmt.Errorf("%w: MaxRate must not be negative", ErrInvalidConfig)
	case c.PublishTimeout < 0, c.SaveInterval < 0, c.ReportInterval < 0, c.RetryBackoff < 0, c.IdleCheck < 0:
		return fmt.Errorf("%w: durations must be positive", ErrInvalidConfig)
	}
	return nil
}
