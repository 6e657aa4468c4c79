package check

import (
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"

	"github.com/kvmapper/kvmapper/deploy/chart"
	"github.com/kvmapper/kvmapper/internal/natstest"
)

var release = chart.Release{Name: "kvmapper", Namespace: "kvmapper"}

// rendered are the chart's objects for one set of values.
type rendered struct {
	objs  []chart.Object
	notes string
}

func render(t *testing.T, values map[string]any) rendered {
	t.Helper()
	objs, notes, err := chart.Render(chart.Dir(built.deploy), release, values)
	if err != nil {
		t.Fatalf("rendering the chart: %v", err)
	}
	return rendered{objs, notes}
}

func productionValues(t *testing.T) map[string]any {
	t.Helper()
	v, err := chart.LoadValues(filepath.Join("testdata", "production-values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// one returns the only object of type T, failing when there is none or more.
func one[T any](t *testing.T, r rendered) T {
	t.Helper()
	var found []T
	for _, o := range r.objs {
		if v, ok := o.Typed.(T); ok {
			found = append(found, v)
		}
	}
	if len(found) != 1 {
		t.Fatalf("the chart rendered %d objects of type %T, want 1", len(found), *new(T))
	}
	return found[0]
}

func all[T any](r rendered) []T {
	var found []T
	for _, o := range r.objs {
		if v, ok := o.Typed.(T); ok {
			found = append(found, v)
		}
	}
	return found
}

// The chart renders with Helm's SDK, for the defaults and for a production values file, and
// every object decodes strictly into its API type (chart.Render fails otherwise); each has the
// kinds a user expects.
func TestChartRenders(t *testing.T) {
	for name, values := range map[string]map[string]any{"defaults": nil, "production": productionValues(t)} {
		t.Run(name, func(t *testing.T) {
			r := render(t, values)
			var kinds []string
			for _, o := range r.objs {
				kinds = append(kinds, o.Kind)
				t.Logf("%s %s (%s) hook=%q", o.Kind, o.Name, o.Source, o.Hook)
			}
			want := []string{"Deployment", "Job", "PodDisruptionBudget", "Service", "ServiceAccount"}
			if name == "production" {
				want = append(want, "ConfigMap", "PrometheusRule", "ServiceMonitor")
			}
			for _, k := range want {
				if !slices.Contains(kinds, k) {
					t.Errorf("no %s rendered (got %v)", k, kinds)
				}
			}
			job := one[*batchv1.Job](t, r)
			for _, o := range r.objs {
				if o.Kind == "Job" && o.Hook != "pre-install,pre-upgrade" {
					t.Errorf("the setup Job is hook %q, want pre-install,pre-upgrade", o.Hook)
				}
			}
			if got := job.Spec.Template.Spec.RestartPolicy; got != corev1.RestartPolicyNever {
				t.Errorf("the setup Job's restart policy %q, want Never", got)
			}
			d := one[*appsv1.Deployment](t, r)
			if n := *d.Spec.Replicas; name == "production" && n != 3 {
				t.Errorf("replicas %d, want 3", n)
			}
			if !strings.Contains(r.notes, "kvmapper status") {
				t.Errorf("NOTES.txt does not say how to see the partitions:\n%s", r.notes)
			}
		})
	}
}

// A strict decode is what the checks above stand on: a field the API type does not have, or
// one of the wrong case, fails the render.
func TestChartStrictDecodeRefusesUnknownFields(t *testing.T) {
	dir := t.TempDir()
	src := chart.Dir(built.deploy)
	if err := os.CopyFS(dir, os.DirFS(src)); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ file, from, to, want string }{
		{"_podtemplate.tpl", "  automountServiceAccountToken: false\n", "  automountServiceAccountToken: false\n  hostNetworking: true\n", `unknown field "spec.template.spec.hostNetworking"`},
		{"deployment.yaml", "  replicas: {{ .Values.replicaCount }}", "  Replicas: {{ .Values.replicaCount }}", `unknown field "spec.Replicas"`},
	} {
		p := filepath.Join(dir, "templates", tc.file)
		orig := readFile(t, filepath.Join(src, "templates", tc.file))
		if !strings.Contains(orig, tc.from) {
			t.Fatalf("%s has no %q any more: update the test", tc.file, tc.from)
		}
		if err := os.WriteFile(p, []byte(strings.Replace(orig, tc.from, tc.to, 1)), 0o644); err != nil {
			t.Fatal(err)
		}
		_, _, err := chart.Render(dir, release, nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("rendering with %q: %v, want an error naming %s", tc.to, err, tc.want)
		}
		if err := os.WriteFile(p, []byte(orig), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// Every selector selects the replicas' pods and nothing else: the Deployment's own, the
// PodDisruptionBudget's, the metrics Service's, the anti-affinity's; the ServiceMonitor
// selects the Service. The setup Job's pods are none of them.
func TestChartSelectorsMatch(t *testing.T) {
	for name, values := range map[string]map[string]any{"defaults": nil, "production": productionValues(t)} {
		t.Run(name, func(t *testing.T) {
			r := render(t, values)
			d := one[*appsv1.Deployment](t, r)
			pods := labels.Set(d.Spec.Template.Labels)
			setupPods := labels.Set(one[*batchv1.Job](t, r).Spec.Template.Labels)
			check := func(what string, sel labels.Selector) {
				t.Helper()
				if !sel.Matches(pods) {
					t.Errorf("%s (%s) does not select the replicas' pods %v", what, sel, pods)
				}
				if sel.Matches(setupPods) {
					t.Errorf("%s (%s) selects the setup Job's pods %v", what, sel, setupPods)
				}
			}
			check("the Deployment's selector", labels.SelectorFromSet(d.Spec.Selector.MatchLabels))
			check("the PodDisruptionBudget", labels.SelectorFromSet(one[*policyv1.PodDisruptionBudget](t, r).Spec.Selector.MatchLabels))
			svc := one[*corev1.Service](t, r)
			check("the metrics Service", labels.SelectorFromSet(svc.Spec.Selector))
			aff := d.Spec.Template.Spec.Affinity.PodAntiAffinity
			var terms []corev1.PodAffinityTerm
			terms = append(terms, aff.RequiredDuringSchedulingIgnoredDuringExecution...)
			for _, w := range aff.PreferredDuringSchedulingIgnoredDuringExecution {
				terms = append(terms, w.PodAffinityTerm)
			}
			if len(terms) != 1 || terms[0].TopologyKey != "kubernetes.io/hostname" {
				t.Fatalf("anti-affinity terms %+v, want one across nodes", terms)
			}
			if name == "production" && len(aff.RequiredDuringSchedulingIgnoredDuringExecution) != 1 {
				t.Error("antiAffinity: hard did not make the anti-affinity required")
			}
			check("the anti-affinity", labels.SelectorFromSet(terms[0].LabelSelector.MatchLabels))
			port := svc.Spec.Ports[0]
			if port.TargetPort.StrVal != "metrics" || !slices.ContainsFunc(d.Spec.Template.Spec.Containers[0].Ports, func(p corev1.ContainerPort) bool { return p.Name == "metrics" }) {
				t.Errorf("the Service targets port %v, which the container does not name", port.TargetPort)
			}
			for _, sm := range all[*monitoringv1.ServiceMonitor](r) {
				if !labels.SelectorFromSet(sm.Spec.Selector.MatchLabels).Matches(labels.Set(svc.Labels)) {
					t.Errorf("the ServiceMonitor's selector %v does not select the Service %v", sm.Spec.Selector.MatchLabels, svc.Labels)
				}
				if len(sm.Spec.Endpoints) != 1 || sm.Spec.Endpoints[0].Port != port.Name || sm.Spec.Endpoints[0].Path != "/metrics" {
					t.Errorf("the ServiceMonitor scrapes %+v, want port %q path /metrics", sm.Spec.Endpoints, port.Name)
				}
			}
		})
	}
}

// containers returns the kvmapper containers of the rendered pods with the pod spec of each.
func containers(t *testing.T, r rendered) map[string]corev1.Container {
	t.Helper()
	out := map[string]corev1.Container{}
	out["deployment"] = one[*appsv1.Deployment](t, r).Spec.Template.Spec.Containers[0]
	out["setup job"] = one[*batchv1.Job](t, r).Spec.Template.Spec.Containers[0]
	return out
}

// Every argument and environment variable the chart gives kvmapper is one the binary accepts:
// the command and flags parse (kvmapper <args> --help exits 0, an unknown flag exits 2), and
// each variable is one that command's --help lists.
func TestChartSettingsAreKvmappers(t *testing.T) {
	all := map[string]any{}
	for k := range defaultConfig(t) {
		all[k] = "7s"
	}
	for name, values := range map[string]map[string]any{
		"defaults":           nil,
		"production":         productionValues(t),
		"every config value": {"config": all, "setupJob": map[string]any{"config": map[string]any{"no-balance-leaders": true}}},
		"every auth":         everyAuth(),
	} {
		t.Run(name, func(t *testing.T) {
			for what, c := range containers(t, render(t, values)) {
				if len(c.Args) == 0 {
					t.Fatalf("%s: no args: no kvmapper command", what)
				}
				cmd := exec.Command(built.bin, append(slices.Clone(c.Args), "--help")...)
				if out, err := cmd.CombinedOutput(); err != nil {
					t.Errorf("%s: kvmapper %s --help: %v\n%s", what, strings.Join(c.Args, " "), err, out)
				}
				h := helpOf(t, c.Args[0])
				for _, e := range c.Env {
					if _, ok := h.env[e.Name]; !ok && !slices.Contains(goRuntimeEnv, e.Name) {
						t.Errorf("%s: kvmapper %s does not read %s (its --help lists %d variables)", what, c.Args[0], e.Name, len(h.env))
					}
				}
			}
		})
	}
}

// everyAuth sets every connection setting the chart knows at once (rendering only: a replica
// would refuse some together).
func everyAuth() map[string]any {
	secret := func(name string) map[string]any { return map[string]any{"secretName": name} }
	auth := map[string]any{"creds": secret("c"), "nkey": secret("n"), "user": "u", "passwordSecret": secret("p"), "tokenSecret": secret("t"), "context": secret("x")}
	return map[string]any{
		"nats":     map[string]any{"auth": auth, "tls": map[string]any{"secretName": "tls", "cert": "tls.crt", "key": "tls.key", "handshakeFirst": true}},
		"setupJob": map[string]any{"auth": auth},
	}
}

// defaultConfig returns the chart's values.yaml config map.
func defaultConfig(t *testing.T) map[string]any {
	t.Helper()
	v, err := chart.LoadValues(filepath.Join(chart.Dir(built.deploy), "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	cfg, ok := v["config"].(map[string]any)
	if !ok {
		t.Fatal("values.yaml has no config map")
	}
	return cfg
}

// notForKubernetes are the flags of kvmapper run that a Kubernetes deployment never sets: an
// embedded NATS server in each replica is not how replicas beside a NATS deployment run.
var notForKubernetes = []string{"embedded", "listen", "data-dir"}

// Every flag a user sets is a value: each flag of `kvmapper run` and `kvmapper setup`, as the
// binary lists them, is a key of values.yaml's config (or setupJob.config), or one the chart
// sets from its own values (the connection, the replica's name, the metrics address); each
// config key setup takes reaches the setup Job too.
func TestChartCoversEveryFlag(t *testing.T) {
	cfg := defaultConfig(t)
	setAll := map[string]any{}
	for k := range cfg {
		setAll[k] = "7s"
	}
	values := everyAuth()
	values["config"] = setAll
	values["setupJob"].(map[string]any)["config"] = map[string]any{"no-balance-leaders": true}
	cs := containers(t, render(t, values))
	for what, c := range cs {
		h := helpOf(t, c.Args[0])
		setBy := map[string]bool{}
		for _, e := range c.Env {
			setBy[h.env[e.Name]] = true
		}
		for _, f := range slices.Sorted(maps.Keys(h.flagEnv)) {
			switch {
			case f == "help" || slices.Contains(notForKubernetes, f):
			case !setBy[f]:
				t.Errorf("%s: kvmapper %s --%s is neither set by the chart nor a key of config in values.yaml (add it there, by its name)", what, c.Args[0], f)
			}
		}
	}
	for k := range cfg {
		if !helpOf(t, "run").flags[k] {
			t.Errorf("values.yaml config.%s is no flag of kvmapper run", k)
		}
	}
}

// The plain manifests of deploy/kubernetes/ and the plain rule file of deploy/prometheus/ are
// what the chart renders now.
func TestPlainManifestsAreCurrent(t *testing.T) {
	files, err := chart.Plain(built.deploy)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := files["prometheus/kvmapper-rules.yaml"]; !ok || len(files) != 4 {
		t.Errorf("chart.Plain renders %d files, want kubernetes/{kvmapper,setup-job,monitoring}.yaml and prometheus/kvmapper-rules.yaml", len(files))
	}
	for name, want := range files {
		if got := readFile(t, filepath.Join(built.deploy, filepath.FromSlash(name))); got != string(want) {
			t.Errorf("deploy/%s is not what the chart renders: run go -C deploy run ./cmd/render", name)
		}
	}
}

// The chart's PrometheusRule, as the production values render it, is the plain rule file, group
// for group (the alerts' checks read that file); the dashboard ConfigMap holds the dashboard.
func TestPrometheusRuleIsTheRulesFile(t *testing.T) {
	pr := one[*monitoringv1.PrometheusRule](t, render(t, productionValues(t)))
	var file monitoringv1.PrometheusRuleSpec
	if err := yaml.UnmarshalStrict([]byte(readFile(t, rulesFile())), &file); err != nil {
		t.Fatal(err)
	}
	a, _ := yaml.Marshal(pr.Spec)
	b, _ := yaml.Marshal(file)
	if string(a) != string(b) {
		t.Errorf("the PrometheusRule's spec differs from %s:\n%s\nwant\n%s", rulesFile(), a, b)
	}
	cm := one[*corev1.ConfigMap](t, render(t, productionValues(t)))
	if got, want := cm.Data["kvmapper-dashboard.json"], readFile(t, dashboardFile()); got != want {
		i := 0
		for i < len(got) && i < len(want) && got[i] == want[i] {
			i++
		}
		t.Errorf("the dashboard ConfigMap does not hold %s as it is: from byte %d it has %q, the file %q", dashboardFile(), i, got[i:min(len(got), i+40)], want[i:min(len(want), i+40)])
	}
}

// deployment runs a rendered release against NATS as Kubernetes would: the setup Job's
// container to completion, then the Deployment's pods.
type deployment struct {
	t       *testing.T
	r       rendered
	secrets map[string]map[string][]byte
	servers string
	pods    []*pod
	procs   []*process
}

func (d *deployment) setup() {
	d.t.Helper()
	job := one[*batchv1.Job](d.t, d.r)
	p := newPod(d.t, job.Name+"-x7k2q", job.Spec.Template.Spec, "setup", d.secrets, d.servers)
	proc := p.start()
	deadline := time.Duration(*job.Spec.ActiveDeadlineSeconds) * time.Second
	if code := proc.wait(deadline); code != 0 {
		d.t.Fatalf("the setup Job's container exited %d:\n%s", code, proc.out.String())
	}
}

// replicas starts every replica of the Deployment and waits until each probe answers 200.
func (d *deployment) replicas() {
	d.t.Helper()
	dep := one[*appsv1.Deployment](d.t, d.r)
	for i := range int(*dep.Spec.Replicas) {
		p := newPod(d.t, fmt.Sprintf("%s-6d8f9c7b5-%c%c", dep.Name, 'a'+i, 'q'+i), dep.Spec.Template.Spec, "kvmapper", d.secrets, d.servers)
		d.pods = append(d.pods, p)
		d.procs = append(d.procs, p.start())
	}
	for _, p := range d.pods {
		for _, pr := range []*corev1.Probe{p.container.LivenessProbe, p.container.ReadinessProbe} {
			url := p.probeURL(pr)
			eventually(d.t, 60*time.Second, func() error {
				code, body, err := get(url)
				if err != nil || code != 200 {
					return fmt.Errorf("%s: GET %s = %d %q, %v; want 200", p.name, url, code, body, err)
				}
				return nil
			})
		}
	}
}

// owned waits until the replicas together hold every partition.
func (d *deployment) owned(partitions int) {
	d.t.Helper()
	eventually(d.t, 60*time.Second, func() error {
		total := 0
		for _, p := range d.pods {
			_, body, err := get("http://" + p.metricsAddr + "/metrics")
			if err != nil {
				return err
			}
			m := regexp.MustCompile(`(?m)^kvmapper_partitions_owned (\d+)$`).FindStringSubmatch(body)
			if m == nil {
				return fmt.Errorf("%s exports no kvmapper_partitions_owned", p.name)
			}
			n, _ := strconv.Atoi(m[1])
			total += n
		}
		if total != partitions {
			return fmt.Errorf("the replicas own %d partitions together, want %d", total, partitions)
		}
		return nil
	})
}

// stop stops every replica as the kubelet does (SIGTERM after the preStop pause, which the
// check does not wait out) and wants each to exit 0 within what is left of the grace period.
func (d *deployment) stop() {
	d.t.Helper()
	spec := one[*appsv1.Deployment](d.t, d.r).Spec.Template.Spec
	grace := time.Duration(*spec.TerminationGracePeriodSeconds) * time.Second
	if ps := spec.Containers[0].Lifecycle.PreStop; ps != nil && ps.Sleep != nil {
		grace -= time.Duration(ps.Sleep.Seconds) * time.Second
	}
	for i, proc := range d.procs {
		if code := proc.stop(grace); code != 0 {
			d.t.Errorf("%s exited %d after SIGTERM, want 0", d.pods[i].name, code)
		}
	}
}

// The default values, run as rendered against a NATS server without authentication: the setup
// Job completes, the replicas' probes answer on the paths and port the chart gives them, they
// share every partition, their Go runtime runs with the chart's GOMEMLIMIT, and they stop
// cleanly within the grace period.
func TestChartDefaultsRunAsRendered(t *testing.T) {
	srv := natstest.Start(t)
	d := &deployment{t: t, r: render(t, nil), servers: srv.ClientURL()}
	d.setup()
	d.replicas()
	d.owned(16)
	// The Go runtime took the chart's GOMEMLIMIT as the bytes it says.
	want, _ := env(t, one[*appsv1.Deployment](t, d.r).Spec.Template.Spec.Containers[0], "GOMEMLIMIT")
	for _, p := range d.pods {
		_, body, err := get("http://" + p.metricsAddr + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		m := regexp.MustCompile(`(?m)^go_gc_gomemlimit_bytes (\S+)$`).FindStringSubmatch(body)
		if n, _ := strconv.ParseFloat(want, 64); m == nil || m[1] != strconv.FormatFloat(n, 'g', -1, 64) && m[1] != want {
			t.Errorf("%s: go_gc_gomemlimit_bytes %v, want the chart's GOMEMLIMIT %s", p.name, m, want)
		}
	}
	d.stop()
}
