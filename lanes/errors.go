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
	// ErrFenceWrite is wrapped by the error [Pool.Run] returns when the lane could not write its
	// partition's fence record in one of its output streams, so it may not write there: the
	// stream refused it for good (full and nothing of the partition's to make room for it, not
	// capturing its fence subjects, not allowing what the record needs), or gave no answer for
	// [Config.FenceTimeout]. The lane wrote nothing; its owner should release the partition
	// (the error says what to fix), not hold it.
	ErrFenceWrite = errors.New("lanes: the partition's fence record cannot be written")
)
