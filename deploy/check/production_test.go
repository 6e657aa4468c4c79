package check

import (
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

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
		// The replicas' own series, as Prometheus would hold them for 5 minutes: the
		// partition count against the leases held is silent with every replica there, and
		// fires once one replica's series are gone (its partitions not yet taken over).
		rule := alertRule(t, "KvmapperPartitionUnowned")
		for _, tc := range []struct {
			name  string
			from  []string
			fires bool
		}{{"every replica scraped", scrapes, false}, {"one replica's series gone", scrapes[1:], true}} {
			sc := scenario{name: tc.name, step: time.Minute, series: scrapedSeries(tc.from, 5, "kvmapper_partitions_configured", "kvmapper_partitions_owned")}
			fired, err := evalAlert(rule.Expr, time.Duration(rule.For), sc)
			if err != nil {
				t.Fatal(err)
			}
			if fired != tc.fires {
				t.Errorf("KvmapperPartitionUnowned over the replicas' series (%s): fired = %v, want %v:%s", tc.name, fired, tc.fires, sc.series)
			}
		}
	})
	d.stop()
}

// scrapedSeries returns the samples of the named metrics in scrapes as a scenario's series, each
// scrape a replica of job kvmapper (instance 10.0.0.<n>:9090), each value held for steps.
func scrapedSeries(scrapes []string, steps int, names ...string) string {
	var b strings.Builder
	line := regexp.MustCompile(`^([a-z_]+)(?:\{(.*)\})? (\S+)$`)
	for i, body := range scrapes {
		for l := range strings.SplitSeq(body, "\n") {
			m := line.FindStringSubmatch(l)
			if m == nil || !slices.Contains(names, m[1]) {
				continue
			}
			lbls := fmt.Sprintf(`namespace="kv",job="kvmapper",instance="10.0.0.%d:9090"`, i+1)
			if m[2] != "" {
				lbls += "," + m[2]
			}
			fmt.Fprintf(&b, "\n%s{%s} %sx%d", m[1], lbls, m[3], steps)
		}
	}
	return b.String()
}
