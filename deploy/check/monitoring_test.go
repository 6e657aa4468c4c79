package check

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
)

// rulesFile is the plain Prometheus rule file, rendered from the chart's
// files/kvmapper-rules.yaml with the default values (TestPlainManifestsAreCurrent keeps it so).
func rulesFile() string {
	return filepath.Join(built.deploy, "prometheus", "kvmapper-rules.yaml")
}

func dashboardFile() string {
	return filepath.Join(chartDirOf(), "files", "kvmapper-dashboard.json")
}

func chartDirOf() string { return filepath.Join(built.deploy, "helm", "kvmapper") }

// prometheusMade are the series Prometheus itself writes for every target, which no replica
// exports: `up` says whether the scrape worked.
var prometheusMade = []string{"up"}

var promql = parser.NewParser(parser.Options{})

// metricsOf returns the metric names an expression selects.
func metricsOf(t *testing.T, expr string) ([]string, error) {
	t.Helper()
	e, err := promql.ParseExpr(expr)
	if err != nil {
		return nil, err
	}
	var names []string
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		if vs, ok := n.(*parser.VectorSelector); ok {
			name := vs.Name
			for _, m := range vs.LabelMatchers {
				if m.Name == model.MetricNameLabel {
					name = m.Value
				}
			}
			if name == "" {
				t.Errorf("%q selects series by labels alone: name the metric", vs)
			}
			names = append(names, name)
		}
		return nil
	})
	return names, nil
}

// rules parses the rule file as Prometheus does (unknown fields refused, every expression and
// template parsed).
func rules(t *testing.T) *rulefmt.RuleGroups {
	t.Helper()
	groups, errs := rulefmt.ParseFile(rulesFile(), false, model.UTF8Validation, promql, slog.New(slog.DiscardHandler))
	for _, err := range errs {
		t.Errorf("rules: %v", err)
	}
	if groups == nil || len(groups.Groups) == 0 {
		t.Fatalf("%s has no rule groups", rulesFile())
	}
	return groups
}

// Every alert rule parses with Prometheus's own rule and PromQL parsers, has a severity, and a
// runbook: a section of docs/deploy-alerts.md named after it.
func TestAlertRulesParseAndHaveRunbooks(t *testing.T) {
	doc := readFile(t, filepath.Join(built.repo, "docs", "deploy-alerts.md"))
	n := 0
	for _, g := range rules(t).Groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				continue
			}
			n++
			if _, err := metricsOf(t, r.Expr); err != nil {
				t.Errorf("%s: %v", r.Alert, err)
			}
			if s := r.Labels["severity"]; s != "critical" && s != "warning" {
				t.Errorf("%s: severity %q, want critical or warning", r.Alert, s)
			}
			anchor := strings.ToLower(r.Alert)
			if want := "https://github.com/kvmapper/kvmapper/blob/main/docs/deploy-alerts.md#" + anchor; r.Annotations["runbook_url"] != want {
				t.Errorf("%s: runbook_url %q, want %q", r.Alert, r.Annotations["runbook_url"], want)
			}
			if !regexp.MustCompile(`(?m)^#+ ` + regexp.QuoteMeta(r.Alert) + `\s*$`).MatchString(doc) {
				t.Errorf("%s: docs/deploy-alerts.md has no section %q (its runbook)", r.Alert, r.Alert)
			}
			for _, k := range []string{"summary", "description"} {
				if r.Annotations[k] == "" {
					t.Errorf("%s: no %s", r.Alert, k)
				}
			}
		}
	}
	if n < 8 {
		t.Errorf("%d alerts, want at least the 8 of issue 22", n)
	}
}

// grafanaVars are the dashboard's variables, replaced as Grafana would before the query
// reaches Prometheus.
var grafanaVars = regexp.MustCompile(`\$\{?(__\w+|\w+)\}?`)

func grafanaToPromQL(q string) string {
	return grafanaVars.ReplaceAllStringFunc(q, func(v string) string {
		if strings.Contains(v, "__") {
			return "1m" // $__rate_interval, $__interval, $__range
		}
		return ".*" // $namespace, $job: regular expressions of their values
	})
}

type dashboard struct {
	Title      string `json:"title"`
	UID        string `json:"uid"`
	Templating struct {
		List []struct {
			Name, Type string
			Query      any    `json:"query"`
			Definition string `json:"definition"`
		} `json:"list"`
	} `json:"templating"`
	Panels []struct {
		ID      int    `json:"id"`
		Type    string `json:"type"`
		Title   string `json:"title"`
		GridPos struct {
			H, W, X, Y int
		} `json:"gridPos"`
		Datasource *struct {
			Type, UID string
		} `json:"datasource"`
		Targets []struct {
			Expr  string `json:"expr"`
			RefID string `json:"refId"`
		} `json:"targets"`
	} `json:"panels"`
}

func loadDashboard(t *testing.T) dashboard {
	t.Helper()
	var d dashboard
	if err := json.Unmarshal([]byte(readFile(t, dashboardFile())), &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile(), err)
	}
	return d
}

// Every query of the dashboard parses with Prometheus's parser (its variables replaced as
// Grafana does), on the dashboard's datasource variable; and the dashboard has the panels
// issue 22 names.
func TestDashboardQueriesParse(t *testing.T) {
	d := loadDashboard(t)
	if d.UID == "" || d.Title == "" {
		t.Error("the dashboard has no uid or title")
	}
	ids := map[int]bool{}
	var titles []string
	for _, p := range d.Panels {
		if ids[p.ID] {
			t.Errorf("panel id %d twice", p.ID)
		}
		ids[p.ID] = true
		if p.Type == "row" {
			continue
		}
		titles = append(titles, strings.ToLower(p.Title))
		if p.Datasource == nil || p.Datasource.UID != "${datasource}" {
			t.Errorf("panel %q: datasource %+v, want the ${datasource} variable", p.Title, p.Datasource)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			if _, err := metricsOf(t, grafanaToPromQL(tg.Expr)); err != nil {
				t.Errorf("panel %q query %s: %v\n%s", p.Title, tg.RefID, err, tg.Expr)
			}
		}
	}
	for _, want := range []string{"mapped per second", "lag per partition", "partitions owned", "ownership changes", "dead letters", "publish latency", "stream leaders",
		"parked devices", "ownership events", "control watch restarts", "fence records not written", "write mode"} {
		if !slices.ContainsFunc(titles, func(s string) bool { return strings.Contains(s, want) }) {
			t.Errorf("no panel titled with %q (panels: %q)", want, titles)
		}
	}
}

// deploymentWide are the dashboard's queries, by panel title and refId, that read every replica
// of the deployment whatever the Replica variable says: a part of the whole means nothing there.
var deploymentWide = map[string]string{"Partitions owned": "B"}

// The dashboard narrows every query to the namespace, job and replica chosen: it has an instance
// variable (its values the instances of the chosen job), and each selector of every query
// matches namespace=~"$namespace", job=~"$job" and instance=~"$instance" (deploymentWide the
// last aside). Its panels do not overlap on Grafana's 24-column grid.
func TestDashboardFiltersByReplica(t *testing.T) {
	d := loadDashboard(t)
	var vars []string
	for _, v := range d.Templating.List {
		vars = append(vars, v.Name)
		if v.Name == "instance" && (v.Type != "query" || !regexp.MustCompile(`^label_values\(kvmapper_\w+\{namespace=~"\$namespace", job=~"\$job"\}, instance\)$`).MatchString(v.Definition)) {
			t.Errorf("the instance variable is a %s of %q, want a query of label_values(kvmapper_…{namespace, job}, instance)", v.Type, v.Definition)
		}
	}
	if !slices.Contains(vars, "instance") {
		t.Fatalf("the dashboard's variables %q have no instance", vars)
	}
	marked := regexp.MustCompile(`\$\{?(\w+)\}?`)
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			q := marked.ReplaceAllStringFunc(tg.Expr, func(v string) string {
				if strings.Contains(v, "__") {
					return "1m"
				}
				return "var_" + strings.Trim(v, "${}")
			})
			e, err := promql.ParseExpr(q)
			if err != nil {
				t.Errorf("panel %q query %s: %v", p.Title, tg.RefID, err)
				continue
			}
			want := []string{"namespace", "job", "instance"}
			if deploymentWide[p.Title] == tg.RefID {
				want = want[:2]
			}
			parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
				vs, ok := n.(*parser.VectorSelector)
				if !ok {
					return nil
				}
				for _, l := range want {
					if !slices.ContainsFunc(vs.LabelMatchers, func(m *labels.Matcher) bool {
						return m.Name == l && m.Type == labels.MatchRegexp && m.Value == "var_"+l
					}) {
						t.Errorf("panel %q query %s: %s does not match %s=~\"$%s\"", p.Title, tg.RefID, vs, l, l)
					}
				}
				return nil
			})
		}
	}
	type cell struct{ x, y int }
	taken := map[cell]string{}
	for _, p := range d.Panels {
		g := p.GridPos
		if g.W <= 0 || g.H <= 0 || g.X < 0 || g.X+g.W > 24 {
			t.Errorf("panel %q at %+v: off Grafana's 24-column grid", p.Title, g)
		}
		for x := g.X; x < g.X+g.W; x++ {
			for y := g.Y; y < g.Y+g.H; y++ {
				if other, ok := taken[cell{x, y}]; ok {
					t.Errorf("panel %q at %+v overlaps panel %q", p.Title, g, other)
					return
				}
				taken[cell{x, y}] = p.Title
			}
		}
	}
}

// queried returns every metric the alert rules and the dashboard read, with where.
func queried(t *testing.T) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for _, g := range rules(t).Groups {
		for _, r := range g.Rules {
			names, err := metricsOf(t, r.Expr)
			if err != nil {
				t.Fatalf("%s: %v", r.Alert, err)
			}
			for _, n := range names {
				out[n] = append(out[n], "alert "+r.Alert)
			}
		}
	}
	for _, p := range loadDashboard(t).Panels {
		for _, tg := range p.Targets {
			names, err := metricsOf(t, grafanaToPromQL(tg.Expr))
			if err != nil {
				t.Fatalf("panel %q: %v", p.Title, err)
			}
			for _, n := range names {
				out[n] = append(out[n], fmt.Sprintf("panel %q", p.Title))
			}
		}
	}
	return out
}

// exported returns the metric names of an exposition (the text format).
func exported(body string) map[string]bool {
	out := map[string]bool{}
	for l := range strings.SplitSeq(body, "\n") {
		if l == "" || l[0] == '#' {
			continue
		}
		if i := strings.IndexAny(l, "{ "); i > 0 {
			out[l[:i]] = true
		}
	}
	return out
}

// checkExported fails for every metric an alert or a panel reads that no scrape exported.
func checkExported(t *testing.T, scrapes []string) {
	t.Helper()
	have := map[string]bool{}
	for _, s := range scrapes {
		for n := range exported(s) {
			have[n] = true
		}
	}
	q := queried(t)
	missing := 0
	for _, name := range slices.Sorted(func(yield func(string) bool) {
		for k := range q {
			if !yield(k) {
				return
			}
		}
	}) {
		if !have[name] && !slices.Contains(prometheusMade, name) {
			t.Errorf("%s is read by %s, but no running replica exports it", name, strings.Join(slices.Compact(q[name]), ", "))
			missing++
		}
	}
	if missing == 0 {
		t.Logf("%d metrics read by the alerts and the dashboard, all exported by the replicas", len(q))
	}
}
