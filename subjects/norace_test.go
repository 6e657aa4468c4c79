//go:build !race

package subjects_test

const raceEnabled = false
