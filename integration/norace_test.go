//go:build !race

package integration

// raceBuild says the test binary runs with the race detector (see race_test.go).
const raceBuild = false
