package check

import (
	"strings"
	"testing"

	"github.com/kvmapper/kvmapper/internal/natstest"
)

// The production values, run as rendered against a NATS cluster of three that requires TLS
// with client certificates and user credentials: the setup Job, as the setup user, creates the
// streams and buckets with three replicas; the three replicas, as a user that may not create
// streams, start with the Secrets mounted where the chart says, answer their probes and share
// every partition; every metric an alert rule or a dashboard panel reads is exported by them
// (scraped, on a cluster, so that the followers' series are there too); and they stop cleanly
// within the grace period.
func TestChartProductionRunsAsRendered(t *testing.T) {
	sec := newSecured(t)
	c := natstest.StartCluster(t, 3, sec.mod)
	d := &deployment{
		t: t, r: render(t, productionValues(t)),
		servers: strings.ReplaceAll(c.URLs(0), "nats://", "tls://"),
		secrets: map[string]map[string][]byte{
			"kvmapper-nats-creds":       {"nats.creds": sec.replicaCreds},
			"kvmapper-setup-nats-creds": {"nats.creds": sec.setupCreds},
			"kvmapper-nats-tls":         {"ca.crt": sec.caPEM, "tls.crt": sec.clientCertPEM, "tls.key": sec.clientKeyPEM},
		},
	}
	d.setup()
	d.replicas()
	d.owned(16)
	t.Run("every metric the alerts and the dashboard read is exported", func(t *testing.T) {
		var scrapes []string
		for _, p := range d.pods {
			code, body, err := get("http://" + p.metricsAddr + "/metrics")
			if err != nil || code != 200 {
				t.Fatalf("%s: GET /metrics = %d, %v", p.name, code, err)
			}
			scrapes = append(scrapes, body)
		}
		checkExported(t, scrapes)
	})
	d.stop()
}
