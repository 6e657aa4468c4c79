package lanes

import "errors"

var (
	// ErrInvalidConfig is wrapped by errors from [New] for a configuration it cannot run with.
	ErrInvalidConfig = errors.New("lanes: invalid config")
	// ErrFenced is returned by [Pool.Run] when another owner wrote the partition's checkpoint,
	// or the lease's own clock ran out: this replica must stop publishing for that partition.
	// A caller whose lease is lost cancels the lane's context with ErrFenced as its cause
	// (context.WithCancelCause): the lane then stops at once, resending nothing, and Run
	// returns nil. Any other cause (a release, a shutdown) lets the lane drain.
	ErrFenced = errors.New("lanes: partition fenced by a newer owner")
)
