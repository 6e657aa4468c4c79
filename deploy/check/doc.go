// Package check holds the deploy kit's CI checks, as tests: the image is built (its tarball, the
// index of linux/amd64 and linux/arm64, each image's config, labels, layer and binary), the
// binary taken from this machine's layer runs, the chart renders for the
// default values and for a production values file and every object decodes strictly into its
// Kubernetes API type, every setting the chart, the plain manifests and the systemd unit give
// kvmapper is one the binary itself accepts (asked through its --help and by running it against
// real NATS servers), every metric an alert rule or a dashboard panel reads is exported by a
// running replica, every rule parses with Prometheus's own parser, and systemd-analyze verify
// accepts the unit.
//
// The binary every check runs is the one taken out of the image the test built, from this
// checkout: TestMain builds it once.
package check
