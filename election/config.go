package election

import (
	"fmt"
	"strings"
	"time"

	"github.com/rs/zerolog"
)

// Config tunes an [Elector]. Zero fields take the documented defaults; [New] fills them in and
// validates the result.
type Config struct {
	// ReplicaID names this replica in member.<id> and as the value of the leases it holds.
	// Required; it must be a valid KV key suffix (letters, digits, '-', '_', '=', '/', and dots
	// between non-empty tokens) and unique among running replicas.
	ReplicaID string
	// Partitions is the number of partitions, numbered 0 to Partitions-1. Required, at least 1.
	Partitions int
	// LeaseTTL is the per-key TTL of lease.<p>. The server takes whole seconds, at least 1s.
	// A replica killed outright has its partitions taken over after about this long. Default
	// 2s; see [LeaseTTLFor] for a replicated control bucket, which needs more.
	LeaseTTL time.Duration
	// RenewInterval is how often leases and the member key are renewed. Default LeaseTTL/4.
	RenewInterval time.Duration
	// Margin is the self-fencing safety margin: a lease is valid until the last successful
	// renewal's send time by Clock + LeaseTTL − Margin. It covers the scheduling of the owner's
	// timers and, on a cluster, the difference between the servers' wall clocks (each expires
	// keys by its own). It must be below LeaseTTL − RenewInterval. Default LeaseTTL/15, at least
	// 250ms: 250ms for 2s, 1s for 15s.
	Margin time.Duration
	// Grace is how long a partition may stay unowned before any replica claims it regardless
	// of its quota (the replicas under quota may be slow, partitioned or failing to run it).
	// Default LeaseTTL.
	Grace time.Duration
	// Settle is how long, at start, the member set must stay unchanged before this replica
	// claims free partitions (at most 4×Settle, and no wait when every partition is owned), so
	// that replicas started together claim their quotas at once instead of the first one
	// claiming every partition and handing most back. Default RenewInterval.
	Settle time.Duration
	// MemberTTL is the per-key TTL of member.<id>; whole seconds, at least 1s. Default LeaseTTL.
	MemberTTL time.Duration
	// JudgedExpiry, when set, lets this replica take a lease over (and leave a member out of
	// the quotas) whose owner has not written it for this long of writable time: time in which
	// this replica's own writes to the bucket (its member heartbeat and its renewals, every
	// RenewInterval) were stored and came back on its own watch, with no gap longer than three
	// renew intervals between two of them by this replica's clock or by the stream's
	// timestamps. Seeing its own write come back proves the watch delivered everything stored
	// before it, a renewal included; a gap (the bucket electing its leader, a slow server, the
	// watch restarting) starts the count again, so an election moves no partition. The takeover
	// writes over the revision it judged (a renewal meanwhile keeps the lease with its owner);
	// the server-side TTL stays LeaseTTL, the backstop. Renewals and heartbeats then wait at most
	// RenewInterval for their answer, so that the first after an election is stored within
	// about one interval.
	//
	// An owner judged dead may be alive (stopped, cut off, slow) and still writing its outputs:
	// set JudgedExpiry only when every output of the work refuses a fenced owner's writes
	// (docs/design-fencing.md). Zero turns it off: a lease then ends only when it is released
	// or expires on the server. It must be at least twice RenewInterval and below LeaseTTL.
	JudgedExpiry time.Duration
	// Checked, when set, says what the work of a held lease (its partition and epoch) vouches
	// for: called before every renewal, its answer goes on the renewal in the
	// Kvmapper-Lease-Checked header ("" sends none). The lanes say there which output streams the
	// partition's lane writes fence-checked (wire.FormatChecked). It must be cheap and safe for
	// concurrent use.
	Checked func(partition int, epoch uint64) string
	// Judge, when set, says whether a lease whose last write carried checked in its
	// Kvmapper-Lease-Checked header ("" when none) may be judged dead after JudgedExpiry: its
	// owner's writes are refused once this replica takes the partition over. Any other lease is
	// left to expire on the server. nil judges every lease: the work's every output refuses a
	// deposed owner whatever its build. It is called from the Elector's loop; it must be cheap
	// and safe for concurrent use.
	Judge func(checked string) bool
	// ReleaseTimeout bounds how long the Elector waits for a Work to return after cancelling it,
	// on release and on shutdown. Default 30s.
	ReleaseTimeout time.Duration
	// Clock is the lease clock: it returns the time elapsed since an arbitrary origin and must
	// never go backwards. A lease is valid until the last successful renewal's send time by
	// this clock + LeaseTTL − Margin ([Lease.Valid]). The zero value is the system's boot
	// clock: on Linux CLOCK_BOOTTIME, which, unlike Go's monotonic clock (CLOCK_MONOTONIC),
	// keeps counting while the machine is suspended, so that an owner resuming from a suspend
	// longer than its lease finds the lease expired, as the server has, instead of publishing
	// under it; elsewhere Go's monotonic clock. Both count a stopped process (SIGSTOP, a frozen
	// cgroup) and a long GC. Neither counts a VM pause its hypervisor hides from the guest's
	// clocks (QEMU/KVM with kvm-clock stops them while the VM is paused, snapshotted or in
	// live-migration downtime): such an owner runs on until its next renewal or checkpoint write
	// fails. Tests set Clock to simulate a suspend.
	Clock func() time.Duration
	// Logger receives ownership changes at info level and routine renewals at debug level.
	// The zero value discards everything.
	Logger zerolog.Logger
	// OnChange, if set, is called for every ownership change this replica observes in the
	// bucket (its own and other replicas'), from the goroutine that reads the watch. It must not
	// block.
	OnChange func(Change)
}

// The lease TTLs [LeaseTTLFor] chooses.
const (
	// SingleLeaseTTL is the lease TTL for a control bucket kept by one server.
	SingleLeaseTTL = 2 * time.Second
	// ReplicatedLeaseTTL is the lease TTL for a replicated control bucket: above the longest a
	// JetStream cluster takes to elect the bucket's next leader when its leader dies.
	ReplicatedLeaseTTL = 15 * time.Second
)

// LeaseTTLFor returns the lease TTL for a control bucket stored in replicas copies.
//
// On one server (replicas 1) the bucket is there exactly as long as the server is: 2s, and a
// replica killed outright has its partitions taken over after about 2s.
//
// A replicated bucket is a Raft group. When the server that leads it dies, nothing can be written
// to it until the others elect a new leader: nats-server 2.15 starts an election when a follower
// has heard no heartbeat (sent every 1s) for a random 4–9s (raft.go minElectionTimeout,
// maxElectionTimeout), and a split vote costs another 0.1–0.8s campaign. No lease is renewed
// meanwhile, and the new leader removes every key whose TTL ran out at once: with a 2s TTL one
// server's death lost all 16 leases and stopped every partition for 4.5s. 15s keeps every lease
// through an election that ends within 10s, with 5s to spare for a slow one, so that losing any
// one server moves no partition; a NATS server restarted for an upgrade hands its leadership
// over at once and costs nothing either way. The price: a replica killed outright has its
// partitions taken over after about 15s.
//
// Why not faster, with one writer per partition (I3) kept: an owner may go on mapping only
// while nobody else can claim its partitions, and it must go on mapping through an election of
// up to 10s during which it cannot reach the bucket. So nobody may claim a partition whose owner
// has been silent for less than that, and to the bucket a dead owner is silent exactly as an
// owner that waits for an election is. A faster takeover needs a proof that the owner is dead
// which also holds when it is alive but cut off from the bucket; NATS offers none (a missing
// subscription shows as well while a live replica reconnects to another server).
//
// I3 on a cluster: an owner stops at the send time of its last acknowledged renewal + LeaseTTL
// − Margin by its own clock. The renewal was stored at or after it was sent, stamped with the
// wall clock of the leader that stored it, and the key expires LeaseTTL after that stamp by
// the wall clock of whichever server leads the bucket then; nobody can claim it before (a claim
// is a create, refused while the key exists). So the owner stops at least Margin before anyone
// can claim, as long as the servers' wall clocks agree within Margin (1s with 15s).
func LeaseTTLFor(replicas int) time.Duration {
	if replicas > 1 {
		return ReplicatedLeaseTTL
	}
	return SingleLeaseTTL
}

// Change is one ownership change of a partition, as observed by this replica's watch.
type Change struct {
	// Partition is the partition whose owner changed.
	Partition int
	// OldOwner is the replica that held it last, or "" if none was seen.
	OldOwner string
	// NewOwner is the replica that holds it now, or "" when the lease was released or expired.
	NewOwner string
	// Epoch is the KV revision of the lease key when NewOwner claimed it; 0 when NewOwner is "".
	Epoch uint64
	// Unowned is how long this replica saw the partition without an owner before NewOwner
	// claimed it (measured from the delete or expiry marker, or from this replica's start if it
	// never saw an owner); 0 when NewOwner is "".
	Unowned time.Duration
	// At is when this replica observed the change.
	At time.Time
}

// withDefaults returns cfg with defaults filled in, or an error wrapping [ErrInvalidConfig].
func (cfg Config) withDefaults() (Config, error) {
	bad := func(format string, args ...any) (Config, error) {
		return Config{}, fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	if !validID(cfg.ReplicaID) {
		return bad("replica id %q must be a non-empty KV key suffix", cfg.ReplicaID)
	}
	if cfg.Partitions < 1 {
		return bad("partitions %d must be at least 1", cfg.Partitions)
	}
	if cfg.LeaseTTL == 0 {
		cfg.LeaseTTL = 2 * time.Second
	}
	if cfg.LeaseTTL < time.Second || cfg.LeaseTTL%time.Second != 0 {
		return bad("lease ttl %v must be whole seconds, at least 1s", cfg.LeaseTTL)
	}
	if cfg.RenewInterval == 0 {
		cfg.RenewInterval = cfg.LeaseTTL / 4
	}
	if cfg.RenewInterval <= 0 || cfg.RenewInterval >= cfg.LeaseTTL {
		return bad("renew interval %v must be in (0, lease ttl %v)", cfg.RenewInterval, cfg.LeaseTTL)
	}
	if cfg.Margin == 0 {
		cfg.Margin = max(250*time.Millisecond, cfg.LeaseTTL/15)
	}
	if cfg.Margin < 0 || cfg.Margin >= cfg.LeaseTTL-cfg.RenewInterval {
		return bad("margin %v must be in [0, lease ttl − renew interval = %v)", cfg.Margin, cfg.LeaseTTL-cfg.RenewInterval)
	}
	if cfg.Grace == 0 {
		cfg.Grace = cfg.LeaseTTL
	}
	if cfg.Grace < 0 {
		return bad("grace %v must not be negative", cfg.Grace)
	}
	if cfg.Settle == 0 {
		cfg.Settle = cfg.RenewInterval
	}
	if cfg.Settle < 0 {
		return bad("settle %v must not be negative", cfg.Settle)
	}
	if cfg.MemberTTL == 0 {
		cfg.MemberTTL = cfg.LeaseTTL
	}
	if cfg.MemberTTL < time.Second || cfg.MemberTTL%time.Second != 0 || cfg.MemberTTL <= cfg.RenewInterval {
		return bad("member ttl %v must be whole seconds, at least 1s and above the renew interval", cfg.MemberTTL)
	}
	if cfg.JudgedExpiry < 0 || cfg.JudgedExpiry > 0 && (cfg.JudgedExpiry < 2*cfg.RenewInterval || cfg.JudgedExpiry >= cfg.LeaseTTL) {
		return bad("judged expiry %v must be 0 or in [2 × renew interval = %v, lease ttl %v)", cfg.JudgedExpiry, 2*cfg.RenewInterval, cfg.LeaseTTL)
	}
	if cfg.ReleaseTimeout == 0 {
		cfg.ReleaseTimeout = 30 * time.Second
	}
	if cfg.ReleaseTimeout < 0 {
		return bad("release timeout %v must not be negative", cfg.ReleaseTimeout)
	}
	if cfg.Clock == nil {
		cfg.Clock = bootClock()
	}
	return cfg, nil
}

// validID reports whether id can follow "member." in a KV key: dot-separated non-empty tokens
// of the characters KV keys allow, without wildcards.
func validID(id string) bool {
	if id == "" {
		return false
	}
	for tok := range strings.SplitSeq(id, ".") {
		if tok == "" {
			return false
		}
		for _, c := range tok {
			switch {
			case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
			case c == '-', c == '_', c == '=', c == '/':
			default:
				return false
			}
		}
	}
	return true
}
