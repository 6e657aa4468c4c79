package check

import (
	"context"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/prometheus/model/histogram"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/rulefmt"
	promqlengine "github.com/prometheus/prometheus/promql"
	"github.com/prometheus/prometheus/storage"
	"github.com/prometheus/prometheus/tsdb/chunkenc"
	"github.com/prometheus/prometheus/tsdb/chunks"
	"github.com/prometheus/prometheus/util/annotations"
)

// A scenario is what the replicas exported, in the notation of Prometheus's rule tests (promtool
// test rules, promqltest's load: one series a line, "a+bxn" is a, a+b, … n+1 samples, "_" none),
// scraped every step; the rule is evaluated at each step from the first sample to the last, as
// Prometheus would, `for` included.
type scenario struct {
	name   string
	step   time.Duration
	series string
	fires  bool
}

// r1 and r2 are two replicas of one deployment, scraped as job kvmapper (metrics.job, the
// ServiceMonitor's jobLabel).
const (
	r1 = `namespace="kv",job="kvmapper",instance="10.0.0.1:9090"`
	r2 = `namespace="kv",job="kvmapper",instance="10.0.0.2:9090"`
)

// alertScenarios are, for every alert of the rules file, the fault it is for (it must fire) and
// what looks like it but is no cause to wake anyone (it must not).
var alertScenarios = map[string][]scenario{
	"KvmapperPartitionUnowned": {
		{name: "a dead replica's partitions stay unowned", step: time.Minute, fires: true, series: `
kvmapper_partitions_configured{` + r1 + `} 4x30
kvmapper_partitions_owned{` + r1 + `} 2x30
kvmapper_partitions_configured{` + r2 + `} 4x10
kvmapper_partitions_owned{` + r2 + `} 2x10`},
		{name: "a deployment that never claimed a partition", step: time.Minute, fires: true, series: `
kvmapper_partitions_configured{` + r1 + `} 16x10
kvmapper_partitions_owned{` + r1 + `} 0x10
kvmapper_partitions_configured{` + r2 + `} 16x10
kvmapper_partitions_owned{` + r2 + `} 0x10`},
		{name: "back after an outage of 7 hours, claiming nothing", step: time.Minute, fires: true, series: `
kvmapper_partitions_configured{` + r1 + `} 16x60 _x420 16x10
kvmapper_partitions_owned{` + r1 + `} 16x60 _x420 0x10`},
		{name: "a dead replica's partitions taken over", step: time.Minute, series: `
kvmapper_partitions_configured{` + r1 + `} 4x30
kvmapper_partitions_owned{` + r1 + `} 2x10 4x20
kvmapper_partitions_configured{` + r2 + `} 4x10
kvmapper_partitions_owned{` + r2 + `} 2x10`},
		{name: "one scrape in the middle of a handover", step: time.Minute, series: `
kvmapper_partitions_configured{` + r1 + `} 4x20
kvmapper_partitions_owned{` + r1 + `} 2x10 1 2x9
kvmapper_partitions_configured{` + r2 + `} 4x20
kvmapper_partitions_owned{` + r2 + `} 2x20`},
	},
	"KvmapperAbsent": {
		{name: "no replica ever scraped", step: time.Minute, fires: true, series: `
up{namespace="kv",job="node-exporter",instance="10.0.0.1:9100"} 1x10`},
		{name: "every replica down", step: time.Minute, fires: true, series: `
up{` + r1 + `} 1x2 0x10
up{` + r2 + `} 1x2 0x10`},
		{name: "one replica of two down", step: time.Minute, series: `
up{` + r1 + `} 1x12
up{` + r2 + `} 1x2 0x10`},
		{name: "down for one scrape", step: time.Minute, series: `
up{` + r1 + `} 1x2 0 1x9`},
	},
	"KvmapperPartitionStalled": {
		{name: "messages waiting and the acknowledged sequence frozen", step: time.Minute, fires: true, series: `
kvmapper_partition_lag_messages{` + r1 + `,partition="3"} 40+1x30
kvmapper_partition_acked_sequence{` + r1 + `,partition="3"} 1000x30`},
		{name: "a steady backlog, acknowledged as it goes", step: time.Minute, series: `
kvmapper_partition_lag_messages{` + r1 + `,partition="3"} 50x30
kvmapper_partition_acked_sequence{` + r1 + `,partition="3"} 1000+600x30`},
		{name: "an idle partition", step: time.Minute, series: `
kvmapper_partition_lag_messages{` + r1 + `,partition="3"} 0x30
kvmapper_partition_acked_sequence{` + r1 + `,partition="3"} 1000x30`},
		{name: "a lane that just started, not acknowledged anything yet", step: time.Minute, series: `
kvmapper_partition_lag_messages{` + r1 + `,partition="3"} _x20 50x8
kvmapper_partition_acked_sequence{` + r1 + `,partition="3"} _x20 1000x8`},
		{name: "stuck for 12 minutes, then replaced by an owner that moves on", step: time.Minute, series: `
kvmapper_partition_lag_messages{` + r1 + `,partition="3"} 50x12
kvmapper_partition_acked_sequence{` + r1 + `,partition="3"} 1000x12
kvmapper_partition_lag_messages{` + r2 + `,partition="3"} _x12 50x20
kvmapper_partition_acked_sequence{` + r2 + `,partition="3"} _x12 1000+100x20`},
	},
	"KvmapperPublishFailing": {
		{name: "publishes failing all along", step: time.Minute, fires: true, series: `
kvmapper_publish_failures_total{` + r1 + `} 0+5x40`},
		{name: "one burst (a leader election)", step: time.Minute, series: `
kvmapper_publish_failures_total{` + r1 + `} 0x5 200x35`},
		{name: "no failures", step: time.Minute, series: `
kvmapper_publish_failures_total{` + r1 + `} 0x40`},
	},
	"KvmapperWriteModeSingle": {
		{name: "OUTGOING written singly", step: time.Minute, fires: true, series: `
kvmapper_write_mode{` + r1 + `,stream="OUTGOING",mode="single"} 1x20`},
		{name: "fallen back after a refused batch", step: time.Minute, fires: true, series: `
kvmapper_write_mode{` + r1 + `,stream="OUTGOING",mode="atomic"} 1x5
kvmapper_write_mode{` + r1 + `,stream="OUTGOING",mode="single"} _x5 1x15`},
		{name: "atomic batches", step: time.Minute, series: `
kvmapper_write_mode{` + r1 + `,stream="OUTGOING",mode="atomic"} 1x20
kvmapper_write_mode{` + r1 + `,stream="UNMAPPED",mode="batch"} 1x20`},
		{name: "PARKED, written singly by design", step: time.Minute, series: `
kvmapper_write_mode{` + r1 + `,stream="OUTGOING",mode="atomic"} 1x20
kvmapper_write_mode{` + r1 + `,stream="PARKED",mode="single"} 1x20`},
	},
	"KvmapperFenceWriteFailed": {
		{name: "one fence record not written", step: time.Minute, fires: true, series: `
kvmapper_fence_write_failures_total{` + r1 + `} 0x5 1x10`},
		{name: "counted before the replica's first scrape", step: time.Minute, fires: true, series: `
kvmapper_fence_write_failures_total{` + r1 + `} 1x10`},
		{name: "every fence record written", step: time.Minute, series: `
kvmapper_fence_write_failures_total{` + r1 + `} 0x15`},
	},
	"KvmapperOwnershipChurn": {
		{name: "leases lost and retaken all hour", step: time.Minute, fires: true, series: `
kvmapper_partitions_configured{` + r1 + `} 16x90
kvmapper_ownership_changes_total{` + r1 + `,change="acquired"} 0+5x90
kvmapper_partitions_configured{` + r2 + `} 16x90
kvmapper_ownership_changes_total{` + r2 + `,change="acquired"} 0+5x90`},
		{name: "one rolling restart", step: time.Minute, series: `
kvmapper_partitions_configured{` + r1 + `} 16x90
kvmapper_ownership_changes_total{` + r1 + `,change="acquired"} 0x10 16x80
kvmapper_partitions_configured{` + r2 + `} 16x90
kvmapper_ownership_changes_total{` + r2 + `,change="acquired"} 0x12 16x78`},
		{name: "two rolling restarts in an hour", step: time.Minute, series: `
kvmapper_partitions_configured{` + r1 + `} 16x90
kvmapper_ownership_changes_total{` + r1 + `,change="acquired"} 0x10 16x20 32x60
kvmapper_partitions_configured{` + r2 + `} 16x90
kvmapper_ownership_changes_total{` + r2 + `,change="acquired"} 0x10 16x20 32x60`},
	},
	"KvmapperGroupsWatchLagging": {
		{name: "the watch stuck while the bucket is written", step: time.Minute, fires: true, series: `
kvmapper_table_watch_lag_revisions{` + r1 + `} 0x5 1+1x30
kvmapper_table_revision{` + r1 + `} 100x36`},
		{name: "the watch stuck on a bucket written once", step: time.Minute, fires: true, series: `
kvmapper_table_watch_lag_revisions{` + r1 + `} 0x5 1x30
kvmapper_table_revision{` + r1 + `} 100x36`},
		{name: "far behind while applying", step: time.Minute, fires: true, series: `
kvmapper_table_watch_lag_revisions{` + r1 + `} 5000x30
kvmapper_table_revision{` + r1 + `} 100+50x30`},
		{name: "a busy bucket, a few revisions behind at each scrape", step: time.Minute, series: `
kvmapper_table_watch_lag_revisions{` + r1 + `} 3x30
kvmapper_table_revision{` + r1 + `} 100+100x30`},
		{name: "a burst of puts applied within two scrapes", step: time.Minute, series: `
kvmapper_table_watch_lag_revisions{` + r1 + `} 0x5 5000 200 0x25
kvmapper_table_revision{` + r1 + `} 100x5 200 4900 5100x25`},
		{name: "a quiet bucket, applied", step: time.Minute, series: `
kvmapper_table_watch_lag_revisions{` + r1 + `} 0x30
kvmapper_table_revision{` + r1 + `} 100x30`},
	},
	"KvmapperLagGrowing": {
		{name: "a backlog growing for half an hour", step: time.Minute, fires: true, series: `
kvmapper_partition_lag_messages{` + r1 + `,partition="3"} 2000+100x40`},
		{name: "a large backlog, not growing", step: time.Minute, series: `
kvmapper_partition_lag_messages{` + r1 + `,partition="3"} 50000x40`},
		{name: "a growing backlog under a thousand", step: time.Minute, series: `
kvmapper_partition_lag_messages{` + r1 + `,partition="3"} 0+20x40`},
	},
	"KvmapperDeadLettersRising": {
		{name: "dead letters for half an hour", step: time.Minute, fires: true, series: `
kvmapper_unmapped_total{` + r1 + `,reason="no-group"} 0+10x40`},
		{name: "one burst of dead letters", step: time.Minute, series: `
kvmapper_unmapped_total{` + r1 + `,reason="no-group"} 0x5 50x35`},
	},
	"KvmapperDeadLetterDropped": {
		{name: "one dead letter dropped", step: time.Minute, fires: true, series: `
kvmapper_dropped_total{` + r1 + `} 0x5 1x10`},
		{name: "none dropped", step: time.Minute, series: `
kvmapper_dropped_total{` + r1 + `} 0x15`},
	},
	"KvmapperReordered": {
		{name: "one message reordered", step: time.Minute, fires: true, series: `
kvmapper_reorders_total{` + r1 + `} 0x5 1x10`},
		{name: "counted before the replica's first scrape", step: time.Minute, fires: true, series: `
kvmapper_reorders_total{` + r1 + `} 1x10`},
		{name: "none reordered", step: time.Minute, series: `
kvmapper_reorders_total{` + r1 + `} 0x15`},
	},
	"KvmapperFenced": {
		{name: "one partition fenced", step: time.Minute, fires: true, series: `
kvmapper_fenced_total{` + r1 + `} 0x5 1x10`},
		{name: "counted before the replica's first scrape", step: time.Minute, fires: true, series: `
kvmapper_fenced_total{` + r1 + `} 1x10`},
		{name: "none fenced", step: time.Minute, series: `
kvmapper_fenced_total{` + r1 + `} 0x15`},
	},
	"KvmapperStreamLeaderless": {
		{name: "no leader for three minutes", step: 15 * time.Second, fires: true, series: `
kvmapper_stream_has_leader{` + r1 + `,stream="OUTGOING"} 1x4 0x12
kvmapper_stream_has_leader{` + r2 + `,stream="OUTGOING"} 1x4 0x12`},
		{name: "an election of one scrape", step: 15 * time.Second, series: `
kvmapper_stream_has_leader{` + r1 + `,stream="OUTGOING"} 1x4 0 1x8
kvmapper_stream_has_leader{` + r2 + `,stream="OUTGOING"} 1x4 0 1x8`},
		{name: "one replica cannot see the leader", step: 15 * time.Second, series: `
kvmapper_stream_has_leader{` + r1 + `,stream="OUTGOING"} 0x16
kvmapper_stream_has_leader{` + r2 + `,stream="OUTGOING"} 1x16`},
	},
	"KvmapperControlWatchRestarting": {
		{name: "a restart every minute for two hours", step: time.Minute, fires: true, series: `
kvmapper_control_watch_restarts_total{` + r1 + `} 0+1x120`},
		{name: "one burst during a fault", step: time.Minute, series: `
kvmapper_control_watch_restarts_total{` + r1 + `} 0x10 40x110`},
		{name: "a few faults an hour apart", step: time.Minute, series: `
kvmapper_control_watch_restarts_total{` + r1 + `} 0x10 6x60 12x60`},
	},
	"KvmapperReplicaNotReady": {
		{name: "not ready for ten minutes", step: time.Minute, fires: true, series: `
kvmapper_ready{` + r1 + `} 1x2 0x10`},
		{name: "not ready for one scrape", step: time.Minute, series: `
kvmapper_ready{` + r1 + `} 1x2 0 1x8`},
	},
	"KvmapperReplicaDown": {
		{name: "a replica unreachable for ten minutes", step: time.Minute, fires: true, series: `
up{` + r1 + `} 1x2 0x10`},
		{name: "another job's target down", step: time.Minute, series: `
up{namespace="kv",job="node-exporter",instance="10.0.0.1:9100"} 1x2 0x10`},
		{name: "another job with kvmapper in its name down", step: time.Minute, series: `
up{namespace="kv",job="kvmapper-exporter",instance="10.0.0.1:9100"} 1x2 0x10`},
	},
}

// Every alert of the rules file fires on the fault it is for and keeps quiet on what only looks
// like it, evaluated by Prometheus's own PromQL engine over the series of each scenario; and no
// alert goes without both kinds of scenario.
func TestAlertsFireOnTheirFaultsOnly(t *testing.T) {
	seen := map[string]bool{}
	for _, g := range rules(t).Groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				continue
			}
			seen[r.Alert] = true
			scs := alertScenarios[r.Alert]
			if !slices.ContainsFunc(scs, func(s scenario) bool { return s.fires }) ||
				!slices.ContainsFunc(scs, func(s scenario) bool { return !s.fires }) {
				t.Errorf("%s: no scenario it must fire on and one it must not: add them to alertScenarios", r.Alert)
			}
			for _, sc := range scs {
				t.Run(r.Alert+"/"+sc.name, func(t *testing.T) {
					alerts, err := firingAlerts(r.Expr, time.Duration(r.For), sc)
					if err != nil {
						t.Fatal(err)
					}
					if fired := len(alerts) > 0; fired != sc.fires {
						t.Errorf("fired = %v, want %v; the series:%s", fired, sc.fires, sc.series)
					}
					// What the annotations name ({{ $labels.x }}) each alert carries: an
					// expression that drops a label (absent() of a comparison, a sum without
					// it) leaves the text with a hole, and the alert without its routing.
					for _, a := range alerts {
						for _, l := range annotationLabels(r.Annotations) {
							if a.Get(l) == "" {
								t.Errorf("an alert that fired has no label %s, which its annotations name: %v", l, a)
							}
						}
					}
				})
			}
		}
	}
	for name := range alertScenarios {
		if !seen[name] {
			t.Errorf("alertScenarios has %s, which the rules file does not", name)
		}
	}
}

// alertRule returns the alert rule name of the rules file.
func alertRule(t *testing.T, name string) rulefmt.Rule {
	t.Helper()
	for _, g := range rules(t).Groups {
		for _, r := range g.Rules {
			if r.Alert == name {
				return r
			}
		}
	}
	t.Fatalf("the rules file has no alert %s", name)
	return rulefmt.Rule{}
}

// evalAlert evaluates the alert's expression over sc at each step with Prometheus's own PromQL
// engine, and reports whether the alert was ever firing. Firing is as Prometheus's rule manager
// decides it: a series of the result is pending from the first evaluation that has it, firing
// once it has been in every evaluation for hold, and forgotten at the first that lacks it. (The
// rule manager itself, package rules, and promqltest's storage, package tsdb, would bring the
// notifier's and remote write's cloud SDKs into this module: the series are held here instead.)
func evalAlert(expr string, hold time.Duration, sc scenario) (bool, error) {
	fired, err := firingAlerts(expr, hold, sc)
	return len(fired) > 0, err
}

// firingAlerts is evalAlert returning the label sets of the alerts that fired.
func firingAlerts(expr string, hold time.Duration, sc scenario) ([]labels.Labels, error) {
	series, steps, err := loadSeries(sc)
	if err != nil {
		return nil, err
	}
	engine := promqlengine.NewEngine(promqlengine.EngineOpts{MaxSamples: 1_000_000, Timeout: time.Minute, LookbackDelta: 5 * time.Minute,
		NoStepSubqueryIntervalFn: func(int64) int64 { return time.Minute.Milliseconds() }})
	queryable := storage.QueryableFunc(func(mint, maxt int64) (storage.Querier, error) {
		return &storage.MockQuerier{SelectMockFunction: func(_ bool, _ *storage.SelectHints, ms ...*labels.Matcher) storage.SeriesSet {
			set := &seriesSet{i: -1}
			for _, s := range series {
				if matchAll(s.Labels(), ms) {
					set.series = append(set.series, s)
				}
			}
			return set
		}}, nil
	})
	activeAt := map[string]time.Time{}
	fired := map[string]labels.Labels{}
	for i := range steps {
		ts := time.UnixMilli(0).Add(time.Duration(i) * sc.step)
		q, err := engine.NewInstantQuery(context.Background(), queryable, nil, expr, ts)
		if err != nil {
			return nil, err
		}
		res := q.Exec(context.Background())
		vec, err := res.Vector()
		q.Close()
		if res.Err != nil {
			return nil, res.Err
		}
		if err != nil {
			return nil, err
		}
		now := map[string]bool{}
		for _, s := range vec {
			k := s.Metric.String()
			now[k] = true
			if _, ok := activeAt[k]; !ok {
				activeAt[k] = ts
			}
			if ts.Sub(activeAt[k]) >= hold {
				fired[k] = s.Metric
			}
		}
		for k := range activeAt {
			if !now[k] {
				delete(activeAt, k)
			}
		}
	}
	var out []labels.Labels
	for _, l := range fired {
		out = append(out, l)
	}
	return out, nil
}

// loadSeries reads sc's series with PromQL's own parser of the notation, sorted by labels as a
// querier returns them, and how many steps the longest covers.
func loadSeries(sc scenario) ([]storage.Series, int, error) {
	var out []storage.Series
	steps := 0
	for _, line := range strings.Split(strings.TrimSpace(sc.series), "\n") {
		lset, values, err := promql.ParseSeriesDesc(line) // the parser of monitoring_test.go
		if err != nil {
			return nil, 0, err
		}
		var samples []chunks.Sample
		for i, v := range values {
			if !v.Omitted {
				samples = append(samples, fsample{t: (time.Duration(i) * sc.step).Milliseconds(), f: v.Value})
			}
		}
		steps = max(steps, len(values))
		out = append(out, storage.NewListSeries(lset, samples))
	}
	slices.SortFunc(out, func(a, b storage.Series) int { return labels.Compare(a.Labels(), b.Labels()) })
	return out, steps, nil
}

func matchAll(l labels.Labels, ms []*labels.Matcher) bool {
	for _, m := range ms {
		if !m.Matches(l.Get(m.Name)) {
			return false
		}
	}
	return true
}

// seriesSet is a querier's answer: the series held, in order.
type seriesSet struct {
	series []storage.Series
	i      int
}

func (s *seriesSet) Next() bool                        { s.i++; return s.i < len(s.series) }
func (s *seriesSet) At() storage.Series                { return s.series[s.i] }
func (s *seriesSet) Err() error                        { return nil }
func (s *seriesSet) Warnings() annotations.Annotations { return nil }

// fsample is one float sample.
type fsample struct {
	t int64
	f float64
}

func (s fsample) T() int64                      { return s.t }
func (s fsample) ST() int64                     { return 0 }
func (s fsample) F() float64                    { return s.f }
func (s fsample) H() *histogram.Histogram       { return nil }
func (s fsample) FH() *histogram.FloatHistogram { return nil }
func (s fsample) Type() chunkenc.ValueType      { return chunkenc.ValFloat }
func (s fsample) Copy() chunks.Sample           { return s }

// annotationLabels are the labels an alert's annotations name as {{ $labels.x }}.
func annotationLabels(annotations map[string]string) []string {
	var out []string
	for _, text := range annotations {
		for _, m := range labelRef.FindAllStringSubmatch(text, -1) {
			if !slices.Contains(out, m[1]) {
				out = append(out, m[1])
			}
		}
	}
	return out
}

var labelRef = regexp.MustCompile(`\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)`)
