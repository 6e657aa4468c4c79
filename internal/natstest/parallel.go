package natstest

import (
	"flag"
	"strconv"
)

// WaitingTests is how many tests marked parallel a package whose tests mostly wait (out lease
// TTLs, elections, heartbeats, their own servers' timers) runs at once when `go test` is not
// told (-parallel). Go's default is one per core: on 2 cores the `lanes` and `election` tests used
// under a core between them and took 51 s each; at 4 they took 32 s and 29 s (2026-12-07).
const WaitingTests = 4

// SetParallel sets -test.parallel to n unless the command line gave it, or the race detector is
// on: under it Go's default (one per core) stands, as a race-built server computes where the
// others wait (beside another package under -race, four lanes tests at once ran a setup past
// its 10 s in a CI run of 2026-12-07). Call it from TestMain, after flag.Parse, before m.Run.
func SetParallel(n int) {
	if raceEnabled {
		return
	}
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == "test.parallel" })
	if !set {
		_ = flag.Set("test.parallel", strconv.Itoa(n))
	}
}
