// Package cli is kvmapper's command line: it defines the commands and their flags, maps the flags
// onto each package's Config (checking them before anything dials, so that a bad one exits 2 with
// nothing started), dials NATS through internal/natsconn or starts an embedded server, and
// composes the packages: mapper is the replica, setup, audit, status, replay and bench the other
// commands. Only this package (through internal/natsconn) dials NATS or starts an embedded server.
// It leaves the process to package main, which stamps the [Build] and exits with the code of
// [Main], as natscli's nats/main.go does over its cli package.
package cli
