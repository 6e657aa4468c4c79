package main

import "runtime/debug"

// commit is the VCS revision kvmapper was built from, stamped at build time beside version:
// -ldflags "-X main.version=v1.2.3 -X main.commit=$(git rev-parse HEAD)" (deploy/image does).
// Unstamped, it is the revision the go command recorded, if any.
var commit = ""

// versionLine is what kvmapper --version prints after "kvmapper version ".
func versionLine() string {
	c := commit
	if c == "" {
		if bi, ok := debug.ReadBuildInfo(); ok {
			for _, s := range bi.Settings {
				if s.Key == "vcs.revision" {
					c = s.Value
				}
			}
		}
	}
	if c == "" {
		return version
	}
	return version + " (commit " + c + ")"
}
