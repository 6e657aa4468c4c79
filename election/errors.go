package election

import "errors"

var (
	// ErrInvalidConfig is wrapped by the error [New] returns for an unusable [Config], and by
	// the error [Elector.Run] returns when the bucket cannot hold per-key TTLs.
	ErrInvalidConfig = errors.New("election: invalid config")
	// ErrLeaseLost is the cause of a [Work] context that ended because the lease was lost: a
	// renewal was refused (someone else holds the key) or did not succeed before the lease's
	// own clock ran out.
	ErrLeaseLost = errors.New("election: lease lost")
	// ErrReleased is the cause of a [Work] context that ended because this replica is handing
	// the partition over, on rebalance or shutdown. The lease stays valid until Work returns.
	ErrReleased = errors.New("election: lease released")
	// ErrLeaseHeld reports that a claim lost a compare-and-set race: another replica holds the
	// lease.
	ErrLeaseHeld = errors.New("election: lease held by another replica")
)
