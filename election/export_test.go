package election

// BootClock returns the default lease clock, for tests.
var BootClock = bootClock

// Rank is rank, for tests: the rendezvous owner of a partition.
var Rank = rank

// StopWatch is stopWatch, for tests.
var StopWatch = stopWatch
