package check

import (
	"fmt"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"github.com/prometheus/common/model"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"

	"github.com/kvmapper/kvmapper/deploy/chart"
	"github.com/kvmapper/kvmapper/internal/natstest"
)

// goRuntimeEnv are the variables the chart gives the Go runtime of kvmapper rather than
// kvmapper itself.
var goRuntimeEnv = []string{"GOMEMLIMIT"}

// renderErr renders values and returns the error, failing when there is none.
func renderErr(t *testing.T, values map[string]any, want string) {
	t.Helper()
	_, _, err := chart.Render(chart.Dir(built.deploy), release, values)
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("rendering with %v: %v, want an error naming %q", values, err, want)
	}
}

// The pods' grace period covers what the binary itself says a stop takes (stop_timeout_ms,
// logged at start by each replica as rendered: the drain and the releases in stream mode, the
// release wait and the handoffs still under way in direct mode) after the preStop pause, with
// shutdown.marginSeconds beyond it; each replica then stops within what is left of it. A
// duration the chart cannot read fails the render.
func TestChartGracePeriodCoversTheStop(t *testing.T) {
	for _, tc := range []struct {
		name   string
		config map[string]any
	}{
		{"defaults", nil},
		{"drain 45s", map[string]any{"drain-timeout": "45s"}},
		{"drain 1m30s", map[string]any{"drain-timeout": "1m30s"}},
		// direct-receive all: the test server has no account mapping to stamp the partition.
		{"direct mode", map[string]any{"mode": "direct", "direct-receive": "all"}},
		{"direct mode, handoff 8.5s", map[string]any{"mode": "direct", "direct-receive": "all", "handoff-timeout": "8500ms"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			config := map[string]any{"log-level": "debug"}
			for k, v := range tc.config {
				config[k] = v
			}
			srv := natstest.Start(t) // each case a deployment of its own
			r := render(t, map[string]any{"replicaCount": 1, "config": config})
			spec := one[*appsv1.Deployment](t, r).Spec.Template.Spec
			d := &deployment{t: t, r: r, servers: srv.ClientURL()}
			d.setup()
			d.replicas()
			ms, err := strconv.Atoi(d.procs[0].logValue("a stop hands the partitions over", "stop_timeout_ms", 30*time.Second))
			if err != nil {
				t.Fatal(err)
			}
			stop := time.Duration(ms) * time.Millisecond
			grace := time.Duration(*spec.TerminationGracePeriodSeconds) * time.Second
			if ps := spec.Containers[0].Lifecycle.PreStop; ps != nil && ps.Sleep != nil {
				grace -= time.Duration(ps.Sleep.Seconds) * time.Second
			}
			margin := time.Duration(defaultInt(t, "shutdown", "marginSeconds")) * time.Second
			if grace < stop+margin {
				t.Errorf("terminationGracePeriodSeconds %d leaves %v after the preStop pause; the replica says a stop takes up to %v, and the margin is %v", *spec.TerminationGracePeriodSeconds, grace, stop, margin)
			}
			t.Logf("grace %v after preStop, stop_timeout %v", grace, stop)
			d.stop()
		})
	}
	renderErr(t, map[string]any{"config": map[string]any{"drain-timeout": "10"}}, "config.drain-timeout")
	renderErr(t, map[string]any{"config": map[string]any{"mode": "direct", "handoff-timeout": "5 s"}}, "config.handoff-timeout")
}

// defaultInt returns the number at path of the chart's values.yaml.
func defaultInt(t *testing.T, path ...string) int {
	t.Helper()
	v, err := chart.LoadValues(filepath.Join(chart.Dir(built.deploy), "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var cur any = v
	for _, p := range path {
		m, _ := cur.(map[string]any)
		cur = m[p]
	}
	switch n := cur.(type) {
	case float64:
		return int(n)
	case int64:
		return int(n)
	case int:
		return n
	}
	t.Fatalf("values.yaml %s is %T, not a number", strings.Join(path, "."), cur)
	return 0
}

// The ServiceMonitor's scrapeTimeout is never longer than its interval, which the
// prometheus-operator rejects: 10 s, the interval when shorter, or the value given, which the
// render refuses when it exceeds the interval. Both are durations the operator's CRD accepts.
func TestChartScrapeTimeoutFitsTheInterval(t *testing.T) {
	crdDuration := regexp.MustCompile(`^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$`)
	for _, tc := range []struct {
		interval, timeout, want string
	}{
		{"15s", "", "10s"},
		{"5s", "", "5s"},
		{"1m", "", "10s"},
		{"30s", "20s", "20s"},
	} {
		sm := map[string]any{"enabled": true, "interval": tc.interval}
		if tc.timeout != "" {
			sm["scrapeTimeout"] = tc.timeout
		}
		r := render(t, map[string]any{"metrics": map[string]any{"serviceMonitor": sm}})
		ep := one[*monitoringv1.ServiceMonitor](t, r).Spec.Endpoints[0]
		interval, err1 := model.ParseDuration(string(ep.Interval))
		timeout, err2 := model.ParseDuration(string(ep.ScrapeTimeout))
		if err1 != nil || err2 != nil || !crdDuration.MatchString(string(ep.Interval)) || !crdDuration.MatchString(string(ep.ScrapeTimeout)) {
			t.Errorf("interval %q, scrapeTimeout %q: not durations the CRD accepts (%v, %v)", ep.Interval, ep.ScrapeTimeout, err1, err2)
			continue
		}
		if timeout > interval {
			t.Errorf("interval %s: scrapeTimeout %s is longer (the operator rejects the ServiceMonitor)", ep.Interval, ep.ScrapeTimeout)
		}
		if string(ep.ScrapeTimeout) != tc.want {
			t.Errorf("interval %s, scrapeTimeout %q: rendered %s, want %s", tc.interval, tc.timeout, ep.ScrapeTimeout, tc.want)
		}
	}
	renderErr(t, map[string]any{"metrics": map[string]any{"serviceMonitor": map[string]any{"enabled": true, "interval": "5s", "scrapeTimeout": "10s"}}}, "longer than the interval")
}

// env returns the value of the container's variable name, and whether it has it (once).
func env(t *testing.T, c corev1.Container, name string) (string, bool) {
	t.Helper()
	var vals []string
	for _, e := range c.Env {
		if e.Name == name {
			vals = append(vals, e.Value)
		}
	}
	if len(vals) > 1 {
		t.Errorf("%s is set %d times: %q", name, len(vals), vals)
	}
	if len(vals) == 0 {
		return "", false
	}
	return vals[0], true
}

// GOMEMLIMIT is goMemLimitRatio of the memory limit, in bytes, a form the Go runtime reads (the
// running replica's go_gc_gomemlimit_bytes says so: TestChartDefaultsRunAsRendered); none
// without a limit or with a ratio of 0, and the user's own when extraEnv sets it. A limit the
// chart cannot read, and a ratio above 1, fail the render.
func TestChartGoMemLimit(t *testing.T) {
	mem := func(limit string) map[string]any {
		return map[string]any{"resources": map[string]any{"limits": map[string]any{"memory": limit}}}
	}
	for _, tc := range []struct {
		name   string
		values map[string]any
		want   string // "" for none
	}{
		{"defaults: 0.8 of 512Mi", nil, strconv.Itoa(512 << 20 * 8 / 10)},
		{"1Gi", mem("1Gi"), strconv.Itoa(1 << 30 * 8 / 10)},
		{"2G at 0.9", map[string]any{"resources": mem("2G")["resources"], "goMemLimitRatio": 0.9}, "1800000000"},
		{"ratio 0", map[string]any{"goMemLimitRatio": 0}, ""},
		{"no memory limit", map[string]any{"resources": map[string]any{"limits": nil}}, ""},
		{"extraEnv sets it", map[string]any{"extraEnv": []any{map[string]any{"name": "GOMEMLIMIT", "value": "300MiB"}}}, "300MiB"},
	} {
		c := one[*appsv1.Deployment](t, render(t, tc.values)).Spec.Template.Spec.Containers[0]
		got, ok := env(t, c, "GOMEMLIMIT")
		if got != tc.want || ok != (tc.want != "") {
			t.Errorf("%s: GOMEMLIMIT %q (set: %v), want %q", tc.name, got, ok, tc.want)
		}
	}
	renderErr(t, mem("512MB"), "resources.limits.memory")
	renderErr(t, map[string]any{"goMemLimitRatio": 1.5}, "goMemLimitRatio")
}

// The PodDisruptionBudget lets a node drain evict a replica that is not ready (NATS down, say)
// even when the budget is spent, unless told otherwise.
func TestChartPodDisruptionBudgetEvictsUnhealthyPods(t *testing.T) {
	for _, tc := range []struct {
		policy string
		want   *policyv1.UnhealthyPodEvictionPolicyType
	}{
		{"", nil},
		{"IfHealthyBudget", new(policyv1.IfHealthyBudget)},
	} {
		r := render(t, map[string]any{"podDisruptionBudget": map[string]any{"unhealthyPodEvictionPolicy": tc.policy}})
		got := one[*policyv1.PodDisruptionBudget](t, r).Spec.UnhealthyPodEvictionPolicy
		if (got == nil) != (tc.want == nil) || (got != nil && *got != *tc.want) {
			t.Errorf("unhealthyPodEvictionPolicy %q rendered %s, want %s", tc.policy, policyString(got), policyString(tc.want))
		}
	}
	got := one[*policyv1.PodDisruptionBudget](t, render(t, nil)).Spec.UnhealthyPodEvictionPolicy
	if got == nil || *got != policyv1.AlwaysAllow {
		t.Errorf("the default unhealthyPodEvictionPolicy is %s, want AlwaysAllow", policyString(got))
	}
	renderErr(t, map[string]any{"podDisruptionBudget": map[string]any{"unhealthyPodEvictionPolicy": "Never"}}, "unhealthyPodEvictionPolicy")
}

func policyString(p *policyv1.UnhealthyPodEvictionPolicyType) string {
	if p == nil {
		return "unset"
	}
	return string(*p)
}

// image.digest pins the pods to one image, repository@digest, for the replicas and the setup
// Job alike; a value that is no sha256 digest fails the render.
func TestChartImageByDigest(t *testing.T) {
	digest := "sha256:" + strings.Repeat("0123456789abcdef", 4)
	for what, c := range containers(t, render(t, map[string]any{"image": map[string]any{"repository": "registry.example.com/kvmapper", "tag": "v1", "digest": digest}})) {
		if want := "registry.example.com/kvmapper@" + digest; c.Image != want {
			t.Errorf("%s: image %q, want %q", what, c.Image, want)
		}
	}
	for what, c := range containers(t, render(t, map[string]any{"image": map[string]any{"tag": "v1"}})) {
		if c.Image != "kvmapper:v1" {
			t.Errorf("%s: image %q without a digest, want kvmapper:v1", what, c.Image)
		}
	}
	renderErr(t, map[string]any{"image": map[string]any{"digest": "sha256:abc"}}, "digest")
}

// podTemplate.merge and podTemplate.patch reach what the chart has no value for: a sidecar and
// an init container added, a field of the kvmapper container replaced, one of the pod's
// removed, a map merged; the kvmapper container keeps everything else, the values given are not
// changed by the render, and an operation that cannot apply fails it.
func TestChartPodTemplateMergeAndPatch(t *testing.T) {
	values := func() map[string]any {
		return map[string]any{"podTemplate": map[string]any{
			"merge": map[string]any{
				"metadata": map[string]any{"annotations": map[string]any{"example.com/team": "data"}},
				"spec":     map[string]any{"shareProcessNamespace": true},
			},
			"patch": []any{
				map[string]any{"op": "add", "path": "/spec/containers/-", "value": map[string]any{"name": "sidecar", "image": "busybox", "args": []any{"sleep", "inf"}}},
				map[string]any{"op": "add", "path": "/spec/initContainers", "value": []any{map[string]any{"name": "init", "image": "busybox"}}},
				map[string]any{"op": "add", "path": "/spec/initContainers/0", "value": map[string]any{"name": "first", "image": "busybox"}},
				map[string]any{"op": "replace", "path": "/spec/containers/0/imagePullPolicy", "value": "Always"},
				map[string]any{"op": "remove", "path": "/spec/affinity"},
				map[string]any{"op": "add", "path": "/metadata/labels/example.com~1tier", "value": "backend"},
			},
		}}
	}
	plain := one[*appsv1.Deployment](t, render(t, nil)).Spec.Template
	v := values()
	pod := one[*appsv1.Deployment](t, render(t, v)).Spec.Template
	var names []string
	for _, c := range pod.Spec.Containers {
		names = append(names, c.Name)
	}
	var inits []string
	for _, c := range pod.Spec.InitContainers {
		inits = append(inits, c.Name)
	}
	switch {
	case !slices.Equal(names, []string{"kvmapper", "sidecar"}):
		t.Errorf("containers %q, want kvmapper and the sidecar", names)
	case !slices.Equal(inits, []string{"first", "init"}):
		t.Errorf("init containers %q, want first and init", inits)
	case pod.Spec.Containers[0].ImagePullPolicy != corev1.PullAlways:
		t.Errorf("the kvmapper container's imagePullPolicy %q, want the patch's Always", pod.Spec.Containers[0].ImagePullPolicy)
	case pod.Spec.Affinity != nil:
		t.Errorf("affinity %+v, want it removed", pod.Spec.Affinity)
	case pod.Spec.ShareProcessNamespace == nil || !*pod.Spec.ShareProcessNamespace:
		t.Error("shareProcessNamespace not merged")
	case pod.Annotations["example.com/team"] != "data" || pod.Labels["example.com/tier"] != "backend":
		t.Errorf("annotations %v, labels %v: the merged annotation or the patched label is missing", pod.Annotations, pod.Labels)
	}
	for k, want := range plain.Labels {
		if pod.Labels[k] != want {
			t.Errorf("label %s = %q, want the chart's %q kept", k, pod.Labels[k], want)
		}
	}
	c, p := pod.Spec.Containers[0], plain.Spec.Containers[0]
	if fmt.Sprint(c.Env, c.Args, c.Ports, c.LivenessProbe, c.ReadinessProbe, c.Resources, c.SecurityContext) !=
		fmt.Sprint(p.Env, p.Args, p.Ports, p.LivenessProbe, p.ReadinessProbe, p.Resources, p.SecurityContext) {
		t.Errorf("the kvmapper container changed beyond the patch:\n%+v\nwant\n%+v", c, p)
	}
	if fmt.Sprint(v) != fmt.Sprint(values()) {
		t.Errorf("rendering changed the values given:\n%v", v)
	}
	patch := func(ops ...any) map[string]any { return map[string]any{"podTemplate": map[string]any{"patch": ops}} }
	op := func(kind, path string) map[string]any {
		return map[string]any{"op": kind, "path": path, "value": "x"}
	}
	renderErr(t, patch(op("remove", "/spec/nodeName")), `no "nodeName"`)
	renderErr(t, patch(op("replace", "/spec/containers/5/image")), "index 5 of a list of 1")
	renderErr(t, patch(op("add", "/spec/containers/x")), `"x" is no index`)
	renderErr(t, patch(op("add", "/spec/serviceAccountName/x")), "not a map or a list")
	renderErr(t, patch(op("move", "/spec/containers/0")), "op")
	renderErr(t, patch(map[string]any{"op": "add", "path": "/spec/hostname"}), "needs a value")
}
