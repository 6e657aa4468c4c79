//go:build race

package integration

// raceBuild says the test binary runs with the race detector: TestMain then builds the kvmapper
// binary the scenarios start with it too, so that `go test -race` covers the processes as well.
const raceBuild = true
