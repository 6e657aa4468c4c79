// Command kvmapper republishes NATS JetStream messages onto subjects that depend on data the
// subject does not carry: incoming.{device}.{event} becomes outgoing.{group}.{device}.{event},
// with the device→group table in a NATS KV bucket, per-device order kept, and partitions shared
// among replicas through KV leases.
//
// Package main holds what the build stamps and the exit code; the command line (the commands,
// their flags and the packages they compose) is internal/cli.
package main

import (
	"os"

	"github.com/kvmapper/kvmapper/internal/cli"
)

// version is stamped at build time with -ldflags "-X main.version=…".
var version = "dev"

func main() {
	os.Exit(cli.Main(os.Args, os.Stdout, os.Stderr, cli.Build{Version: version, Line: versionLine()}))
}
