package election

// BootClock returns the default lease clock, for tests.
var BootClock = bootClock
