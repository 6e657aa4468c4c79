//go:build race

package integration

// raceEnabled says the tests run under the race detector, which slows three servers and three
// replicas in one process on two cores several times over: timing bounds set for the real
// speed are not asserted then, only reported.
const raceEnabled = true
