//go:build race

package natstest

// raceEnabled: the race detector makes every server and test several times slower, so that
// CPU, not waiting, bounds how many tests can run at once.
const raceEnabled = true
