package setup

import (
	"fmt"
	"strings"

	"github.com/kvmapper/kvmapper/subjects"
	"github.com/kvmapper/kvmapper/wire"
)

// NextSteps is what `kvmapper run --embedded` prints once every partition is served, url being
// its server's: the nats CLI commands that map a first device and show its message arrive.
func (cfg Config) NextSteps(url string) string {
	server := ""
	if url != "nats://127.0.0.1:4222" {
		server = " -s " + url
	}
	if cfg.Mode == wire.ModeDirect {
		return fmt.Sprintf(`
kvmapper is mapping %[1]s → %[2]s on %[3]s in direct mode: a device's PubAck comes from %[7]s.
In another terminal try:

  go tool nats%[4]s kv put %[5]s dev-42 %[8]s
  go tool nats%[4]s sub '%[6]s'
  go tool nats%[4]s pub --jetstream incoming.dev-42.temp '{"celsius": 21.5}'
  go tool nats%[4]s req incoming.dev-42.temp '{"celsius": 22.0}'

(any nats CLI works; 'go tool nats' is the one pinned in go.mod). Ctrl-C stops it cleanly.

`, cfg.Layout.In, cfg.Layout.Out, url, server, cfg.Groups, cfg.Layout.OutStreamSubject(), cfg.Outgoing, example(cfg.Layout))
	}
	return fmt.Sprintf(`
kvmapper is mapping %[1]s → %[2]s on %[3]s. In another terminal try:

  go tool nats%[4]s kv put %[5]s dev-42 %[8]s
  go tool nats%[4]s sub '%[6]s'
  go tool nats%[4]s pub incoming.dev-42.temp '{"celsius": 21.5}'

(any nats CLI works; 'go tool nats' is the one pinned in go.mod). Ctrl-C stops it cleanly.

`, cfg.Layout.In, cfg.Layout.Out, url, server, cfg.Groups, cfg.Layout.OutStreamSubject(), "", example(cfg.Layout))
}

// example is a value of the groups bucket that the layout maps, quoted for a shell.
func example(lay *subjects.Layout) string {
	ex := lay.Schema().Example()
	if strings.ContainsAny(ex, "{\"") {
		return "'" + ex + "'"
	}
	return ex
}
