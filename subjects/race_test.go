//go:build race

package subjects_test

// raceEnabled: the race detector makes sync.Pool drop what is put back, so that encoding/json's
// scanner pool allocates now and then.
const raceEnabled = true
