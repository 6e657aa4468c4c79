package check

import (
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
	corev1 "k8s.io/api/core/v1"
	k8slabels "k8s.io/apimachinery/pkg/labels"

	"github.com/kvmapper/kvmapper/deploy/chart"
)

// ruleValues returns values that render the PrometheusRule with the settings pr of
// metrics.prometheusRule (and the rest of metrics from extra).
func ruleValues(pr map[string]any, extra map[string]any) map[string]any {
	p := map[string]any{"enabled": true}
	maps.Copy(p, pr)
	m := map[string]any{"prometheusRule": p}
	maps.Copy(m, extra)
	return map[string]any{"metrics": m}
}

// renderedAlerts renders values and returns the PrometheusRule's alerts by name, in order.
func renderedAlerts(t *testing.T, values map[string]any) ([]string, map[string]monitoringv1.Rule) {
	t.Helper()
	pr := one[*monitoringv1.PrometheusRule](t, render(t, values))
	var names []string
	out := map[string]monitoringv1.Rule{}
	for _, g := range pr.Spec.Groups {
		for _, r := range g.Rules {
			if r.Alert != "" {
				names = append(names, r.Alert)
				out[r.Alert] = r
			}
		}
	}
	return names, out
}

// fileAlerts returns the names of the alerts of the plain rule file, in order.
func fileAlerts(t *testing.T) []string {
	t.Helper()
	var names []string
	for _, g := range rules(t).Groups {
		for _, r := range g.Rules {
			if r.Alert != "" {
				names = append(names, r.Alert)
			}
		}
	}
	return names
}

// metrics.prometheusRule's settings, as kube-prometheus-stack's defaultRules has them: disabled
// leaves alerts out, runbookUrl moves every runbook_url, additionalRuleLabels and
// additionalRuleAnnotations reach every alert without replacing its own, customRules changes one
// alert's for and severity and no other's. A name that is no alert, a severity among the
// additional labels, a runbook_url among the annotations and values the schema does not know
// fail the render.
func TestChartRuleSettings(t *testing.T) {
	all := fileAlerts(t)
	_, plain := renderedAlerts(t, ruleValues(nil, nil))

	names, got := renderedAlerts(t, ruleValues(map[string]any{"disabled": map[string]any{
		"KvmapperOwnershipChurn": true, "KvmapperAbsent": true, "KvmapperLagGrowing": false}}, nil))
	want := slices.DeleteFunc(slices.Clone(all), func(n string) bool { return n == "KvmapperOwnershipChurn" || n == "KvmapperAbsent" })
	if !slices.Equal(names, want) {
		t.Errorf("disabled KvmapperOwnershipChurn and KvmapperAbsent: alerts %q, want %q", names, want)
	}
	for _, n := range want {
		if got[n].Expr != plain[n].Expr || ptrString(got[n].For) != ptrString(plain[n].For) {
			t.Errorf("disabled others: %s changed", n)
		}
	}

	_, got = renderedAlerts(t, ruleValues(map[string]any{"runbookUrl": "https://wiki.example.com/kvmapper/alerts/"}, nil))
	for _, n := range all {
		if want := "https://wiki.example.com/kvmapper/alerts#" + strings.ToLower(n); got[n].Annotations["runbook_url"] != want {
			t.Errorf("runbookUrl: %s's runbook_url %q, want %q", n, got[n].Annotations["runbook_url"], want)
		}
	}

	_, got = renderedAlerts(t, ruleValues(map[string]any{
		"additionalRuleLabels":      map[string]any{"team": "data", "page": true},
		"additionalRuleAnnotations": map[string]any{"dashboard": "https://grafana.example.com/d/kvmapper"},
	}, nil))
	for _, n := range all {
		r, p := got[n], plain[n]
		if r.Labels["team"] != "data" || r.Labels["page"] != "true" || r.Labels["severity"] != p.Labels["severity"] {
			t.Errorf("additionalRuleLabels: %s's labels %v, want team=data, page=true and its own severity %q", n, r.Labels, p.Labels["severity"])
		}
		if r.Annotations["dashboard"] != "https://grafana.example.com/d/kvmapper" || r.Annotations["summary"] != p.Annotations["summary"] {
			t.Errorf("additionalRuleAnnotations: %s's annotations %v, want the dashboard and its own summary", n, r.Annotations)
		}
	}

	_, got = renderedAlerts(t, ruleValues(map[string]any{"customRules": map[string]any{
		"KvmapperLagGrowing": map[string]any{"for": "30m", "severity": "critical"},
		"KvmapperFenced":     map[string]any{"for": "5m"},
	}}, nil))
	for _, n := range all {
		r, p := got[n], plain[n]
		wantFor, wantSev := ptrString(p.For), p.Labels["severity"]
		switch n {
		case "KvmapperLagGrowing":
			wantFor, wantSev = "30m", "critical"
		case "KvmapperFenced":
			wantFor = "5m"
		}
		if ptrString(r.For) != wantFor || r.Labels["severity"] != wantSev {
			t.Errorf("customRules: %s for %q severity %q, want %q %q", n, ptrString(r.For), r.Labels["severity"], wantFor, wantSev)
		}
	}

	pr := func(v map[string]any) map[string]any { return ruleValues(v, nil) }
	renderErr(t, pr(map[string]any{"disabled": map[string]any{"KvmapperLagGrowin": true}}), "KvmapperLagGrowin is no alert")
	renderErr(t, pr(map[string]any{"customRules": map[string]any{"KvmapperFencd": map[string]any{"for": "1m"}}}), "KvmapperFencd is no alert")
	renderErr(t, pr(map[string]any{"customRules": map[string]any{"KvmapperFenced": map[string]any{"severity": "page"}}}), "severity")
	renderErr(t, pr(map[string]any{"customRules": map[string]any{"KvmapperFenced": map[string]any{"for": "5 minutes"}}}), "for")
	renderErr(t, pr(map[string]any{"additionalRuleLabels": map[string]any{"severity": "page"}}), "severity is each alert's own")
	renderErr(t, pr(map[string]any{"additionalRuleAnnotations": map[string]any{"runbook_url": "https://x"}}), "runbookUrl")
	renderErr(t, pr(map[string]any{"thresholds": map[string]any{"lagMesages": 10}}), "lagMesages")
	renderErr(t, pr(map[string]any{"thresholds": map[string]any{"lagMessages": -1}}), "lagMessages")
	renderErr(t, ruleValues(nil, map[string]any{"job": `kv"mapper`}), "job")
}

func ptrString(d *monitoringv1.Duration) string {
	if d == nil {
		return ""
	}
	return string(*d)
}

// thresholdCases change each threshold of metrics.prometheusRule.thresholds so that a scenario
// of alertScenarios goes the other way: the threshold reaches the alert it is for.
type thresholdCase struct {
	threshold string
	value     any
	alert     string
	scenario  string
}

var thresholdCases = []thresholdCase{
	{"lagMessages", 100, "KvmapperLagGrowing", "a growing backlog under a thousand"},
	{"publishFailuresPerSecond", 1, "KvmapperPublishFailing", "publishes failing all along"},
	{"deadLettersPerSecond", 1, "KvmapperDeadLettersRising", "dead letters for half an hour"},
	{"ownershipChangesPerPartitionPerHour", 3, "KvmapperOwnershipChurn", "two rolling restarts in an hour"},
	{"controlWatchRestartsPer15m", 20, "KvmapperControlWatchRestarting", "a restart every minute for two hours"},
	{"groupsWatchLagRevisions", 10000, "KvmapperGroupsWatchLagging", "far behind while applying"},
}

// Every threshold of values.yaml reaches its alert: set to another value, it turns a scenario
// that fired with the default silent or the other way round (evaluated as
// TestAlertsFireOnTheirFaultsOnly does); and no threshold goes without such a case.
func TestChartRuleThresholds(t *testing.T) {
	v, err := chart.LoadValues(filepath.Join(chart.Dir(built.deploy), "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	defaults, _ := v["metrics"].(map[string]any)["prometheusRule"].(map[string]any)["thresholds"].(map[string]any)
	source := readFile(t, filepath.Join(chart.Dir(built.deploy), "files", "kvmapper-rules.yaml"))
	for k := range defaults {
		if !slices.ContainsFunc(thresholdCases, func(c thresholdCase) bool { return c.threshold == k }) {
			t.Errorf("thresholds.%s has no case in thresholdCases", k)
		}
		if !strings.Contains(source, ".thresholds."+k+" ") {
			t.Errorf("thresholds.%s: no rule of files/kvmapper-rules.yaml uses it", k)
		}
	}
	for _, c := range thresholdCases {
		t.Run(c.threshold, func(t *testing.T) {
			i := slices.IndexFunc(alertScenarios[c.alert], func(s scenario) bool { return s.name == c.scenario })
			if i < 0 {
				t.Fatalf("%s has no scenario %q", c.alert, c.scenario)
			}
			sc := alertScenarios[c.alert][i]
			_, rs := renderedAlerts(t, ruleValues(map[string]any{"thresholds": map[string]any{c.threshold: c.value}}, nil))
			r, ok := rs[c.alert]
			if !ok {
				t.Fatalf("no %s rendered", c.alert)
			}
			var hold model.Duration
			if r.For != nil {
				if hold, err = model.ParseDuration(string(*r.For)); err != nil {
					t.Fatal(err)
				}
			}
			fired, err := evalAlert(r.Expr.String(), time.Duration(hold), sc)
			if err != nil {
				t.Fatal(err)
			}
			if fired == sc.fires {
				t.Errorf("%s=%v: %s on %q fired = %v, as with the default %v; the threshold does not reach it:\n%s", c.threshold, c.value, c.alert, sc.name, fired, defaults[c.threshold], r.Expr.String())
			}
		})
	}
}

// The replicas' job label is metrics.job whatever the release, nameOverride or fullnameOverride
// (the ServiceMonitor takes it from the Service's jobLabel label, as Prometheus's operator does:
// the label's value, or the Service's name without one), and it is the job every alert on `up`
// selects, so that absent(up{job=...} == 1) is about these replicas and not another job's.
func TestChartJobIsStable(t *testing.T) {
	for _, tc := range []struct {
		release string
		values  map[string]any
		want    string
	}{
		{"kvmapper", nil, "kvmapper"},
		{"prod-eu", nil, "kvmapper"},
		{"prod-eu", map[string]any{"nameOverride": "mapper"}, "kvmapper"},
		{"prod-eu", map[string]any{"fullnameOverride": "eu-mapper"}, "kvmapper"},
		{"prod-eu", map[string]any{"metrics": map[string]any{"job": "kvmapper-eu"}}, "kvmapper-eu"},
	} {
		values := ruleValues(nil, map[string]any{"serviceMonitor": map[string]any{"enabled": true}})
		maps.Copy(values["metrics"].(map[string]any), dig(tc.values, "metrics"))
		for k, v := range tc.values {
			if k != "metrics" {
				values[k] = v
			}
		}
		objs, _, err := chart.Render(chart.Dir(built.deploy), chart.Release{Name: tc.release, Namespace: "kv"}, values)
		if err != nil {
			t.Fatal(err)
		}
		r := rendered{objs: objs}
		svc := one[*corev1.Service](t, r)
		sm := one[*monitoringv1.ServiceMonitor](t, r)
		job := svc.Name
		if v, ok := svc.Labels[sm.Spec.JobLabel]; sm.Spec.JobLabel != "" && ok {
			job = v
		}
		if job != tc.want {
			t.Errorf("release %s, %v: the replicas' job is %q (Service %s, jobLabel %q), want %q", tc.release, tc.values, job, svc.Name, sm.Spec.JobLabel, tc.want)
		}
		if !k8slabels.SelectorFromSet(sm.Spec.Selector.MatchLabels).Matches(k8slabels.Set(svc.Labels)) {
			t.Errorf("release %s, %v: the ServiceMonitor's selector %v does not select the Service %v", tc.release, tc.values, sm.Spec.Selector.MatchLabels, svc.Labels)
		}
		ups := 0
		for _, g := range one[*monitoringv1.PrometheusRule](t, r).Spec.Groups {
			for _, rule := range g.Rules {
				e, err := promql.ParseExpr(rule.Expr.String())
				if err != nil {
					t.Fatal(err)
				}
				parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
					vs, ok := n.(*parser.VectorSelector)
					if !ok || vs.Name != "up" {
						return nil
					}
					ups++
					var jobM *labels.Matcher
					for _, m := range vs.LabelMatchers {
						if m.Name == "job" {
							jobM = m
						}
					}
					if jobM == nil || jobM.Type != labels.MatchEqual || jobM.Value != job {
						t.Errorf("%s selects %s, want up{job=%q}", rule.Alert, vs, job)
					}
					return nil
				})
			}
		}
		if ups < 2 {
			t.Errorf("%d alerts read up, want KvmapperAbsent and KvmapperReplicaDown", ups)
		}
	}
}

func dig(m map[string]any, key string) map[string]any {
	v, _ := m[key].(map[string]any)
	return v
}
