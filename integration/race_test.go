//go:build race

package integration

// raceEnabled says the tests run under the race detector, which slows three servers and three
// replicas in one process on two cores several times over: timing bounds set for the real
// speed are not asserted then, only reported.
const raceEnabled = true

// raceBuild says TestMain builds the kvmapper binary the scenarios start with the race detector
// too, so that `go test -race` covers the processes as well.
const raceBuild = raceEnabled
