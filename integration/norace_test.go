//go:build !race

package integration

// raceEnabled says the tests run under the race detector (see race_test.go).
const raceEnabled = false

// raceBuild says TestMain builds the kvmapper binary with the race detector (see race_test.go).
const raceBuild = raceEnabled
