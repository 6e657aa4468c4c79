// Package chart renders the kvmapper Helm chart with Helm's own Go SDK, as `helm template` and
// `helm install` do, and decodes each rendered object strictly into its Kubernetes API type: a
// field the type does not have, a duplicate key or a field of the wrong case is an error, as the
// API server's strict field validation makes it.
package chart

import (
	"bytes"
	"errors"
	"fmt"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/releaseutil"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

// Object is one rendered Kubernetes object.
type Object struct {
	// Source is the template it came from, e.g. kvmapper/templates/deployment.yaml.
	Source string
	// Hook is the object's helm.sh/hook annotation ("" for an ordinary object).
	Hook string
	// YAML is the object as rendered.
	YAML string
	// Kind and APIVersion say what it is; Name is its metadata.name.
	Kind, APIVersion, Name string
	// Typed is the object decoded into its API type, e.g. *appsv1.Deployment.
	Typed any
}

// Release names the release a render is for.
type Release struct {
	Name, Namespace string
	// Upgrade renders as for helm upgrade (.Release.IsUpgrade) instead of helm install.
	Upgrade bool
	// KubeVersion is the cluster's Kubernetes version; default [MinKubeVersion].
	KubeVersion string
}

// MinKubeVersion is the oldest Kubernetes the chart supports (Chart.yaml's kubeVersion): the
// first with the preStop sleep action on by default.
const MinKubeVersion = "v1.30.0"

// types maps apiVersion/kind to a new value of its API type: the kinds this chart renders.
var types = map[string]func() any{
	"v1/ServiceAccount":                       func() any { return new(corev1.ServiceAccount) },
	"v1/Service":                              func() any { return new(corev1.Service) },
	"v1/ConfigMap":                            func() any { return new(corev1.ConfigMap) },
	"v1/Secret":                               func() any { return new(corev1.Secret) },
	"apps/v1/Deployment":                      func() any { return new(appsv1.Deployment) },
	"apps/v1/StatefulSet":                     func() any { return new(appsv1.StatefulSet) },
	"batch/v1/Job":                            func() any { return new(batchv1.Job) },
	"policy/v1/PodDisruptionBudget":           func() any { return new(policyv1.PodDisruptionBudget) },
	"monitoring.coreos.com/v1/ServiceMonitor": func() any { return new(monitoringv1.ServiceMonitor) },
	"monitoring.coreos.com/v1/PrometheusRule": func() any { return new(monitoringv1.PrometheusRule) },
}

// Render renders the chart in dir for rel with values over its values.yaml (nil: the defaults),
// and decodes every object strictly into its API type. Objects come in Helm's install order,
// hooks first. NOTES.txt is returned apart.
func Render(dir string, rel Release, values map[string]any) (objs []Object, notes string, err error) {
	ch, err := loader.Load(dir)
	if err != nil {
		return nil, "", fmt.Errorf("loading the chart %s: %w", dir, err)
	}
	caps := chartutil.DefaultCapabilities.Copy()
	if rel.KubeVersion == "" {
		rel.KubeVersion = MinKubeVersion
	}
	kv, err := chartutil.ParseKubeVersion(rel.KubeVersion)
	if err != nil {
		return nil, "", err
	}
	caps.KubeVersion = *kv
	if ch.Metadata.KubeVersion != "" && !chartutil.IsCompatibleRange(ch.Metadata.KubeVersion, caps.KubeVersion.String()) {
		return nil, "", fmt.Errorf("the chart needs Kubernetes %s; rendering for %s", ch.Metadata.KubeVersion, caps.KubeVersion)
	}
	if values == nil {
		values = map[string]any{}
	}
	vals, err := chartutil.ToRenderValues(ch, values, chartutil.ReleaseOptions{
		Name: rel.Name, Namespace: rel.Namespace, Revision: 1, IsInstall: !rel.Upgrade, IsUpgrade: rel.Upgrade,
	}, caps)
	if err != nil {
		return nil, "", fmt.Errorf("values: %w", err)
	}
	files, err := engine.Engine{Strict: true}.Render(ch, vals)
	if err != nil {
		return nil, "", fmt.Errorf("rendering: %w", err)
	}
	for name, content := range files {
		if strings.HasSuffix(name, "NOTES.txt") {
			notes = content
			delete(files, name)
		}
	}
	hooks, manifests, err := releaseutil.SortManifests(files, caps.APIVersions, releaseutil.InstallOrder)
	if err != nil {
		return nil, "", fmt.Errorf("sorting the rendered objects: %w", err)
	}
	for _, h := range hooks {
		var events []string
		for _, e := range h.Events {
			events = append(events, e.String())
		}
		o, err := decode(h.Path, h.Manifest)
		if err != nil {
			return nil, "", err
		}
		o.Hook = strings.Join(events, ",")
		objs = append(objs, o)
	}
	for _, m := range manifests {
		o, err := decode(m.Name, m.Content)
		if err != nil {
			return nil, "", err
		}
		objs = append(objs, o)
	}
	return objs, notes, nil
}

// LoadValues reads a values file.
func LoadValues(path string) (map[string]any, error) {
	v, err := chartutil.ReadValuesFile(path)
	if err != nil {
		return nil, err
	}
	return v.AsMap(), nil
}

// decode decodes one rendered document strictly into its API type.
func decode(source, doc string) (Object, error) {
	js, err := yaml.YAMLToJSONStrict([]byte(doc))
	if err != nil {
		return Object{}, fmt.Errorf("%s: not YAML, or a key given twice: %w", source, err)
	}
	var head struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
		Metadata   struct {
			Name        string            `json:"name"`
			Annotations map[string]string `json:"annotations"`
		} `json:"metadata"`
	}
	if err := kjson.UnmarshalCaseSensitivePreserveInts(js, &head); err != nil {
		return Object{}, fmt.Errorf("%s: %w", source, err)
	}
	key := head.APIVersion + "/" + head.Kind
	newT, ok := types[key]
	if !ok {
		return Object{}, fmt.Errorf("%s: no API type known for %s (add it to the types of deploy/chart)", source, key)
	}
	typed := newT()
	strict, err := kjson.UnmarshalStrict(js, typed, kjson.DisallowDuplicateFields, kjson.DisallowUnknownFields)
	if err != nil {
		return Object{}, fmt.Errorf("%s: %s %q does not decode: %w", source, key, head.Metadata.Name, err)
	}
	if len(strict) > 0 {
		return Object{}, fmt.Errorf("%s: %s %q: %w", source, key, head.Metadata.Name, errors.Join(strict...))
	}
	return Object{Source: source, YAML: doc, Kind: head.Kind, APIVersion: head.APIVersion, Name: head.Metadata.Name, Typed: typed}, nil
}

// Write writes objs as one multi-document YAML stream under a header comment, each document
// headed by its source, in the given order.
func Write(objs []Object, header string) []byte {
	var b bytes.Buffer
	for _, l := range strings.Split(strings.TrimRight(header, "\n"), "\n") {
		b.WriteString("# " + l + "\n")
	}
	for _, o := range objs {
		fmt.Fprintf(&b, "---\n# Source: %s\n%s\n", o.Source, strings.TrimSpace(o.YAML))
	}
	return b.Bytes()
}

// Dir returns the chart's directory from the deploy module's root.
func Dir(deployRoot string) string { return filepath.Join(deployRoot, "helm", "kvmapper") }

// Kinds returns the sorted apiVersion/kind keys Render can decode.
func Kinds() []string {
	var ks []string
	for k := range types {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

// PlainRelease is the release the plain manifests of deploy/kubernetes/ are rendered for.
var PlainRelease = Release{Name: "kvmapper", Namespace: "kvmapper"}

// Plain renders the plain manifests of deploy/kubernetes/ from the chart and
// deploy/kubernetes/values.yaml, and the plain Prometheus rule file
// deploy/prometheus/kvmapper-rules.yaml (the PrometheusRule's spec), by path under deployRoot.
func Plain(deployRoot string) (map[string][]byte, error) {
	valuesFile := filepath.Join(deployRoot, "kubernetes", "values.yaml")
	values, err := LoadValues(valuesFile)
	if err != nil {
		return nil, err
	}
	objs, _, err := Render(Dir(deployRoot), PlainRelease, values)
	if err != nil {
		return nil, err
	}
	var replicas, setup, monitoring []Object
	var rules []byte
	job := ""
	for _, o := range objs {
		if svc, ok := o.Typed.(*corev1.Service); ok {
			job = svc.Labels["jobLabel"]
		}
		if pr, ok := o.Typed.(*monitoringv1.PrometheusRule); ok {
			b, err := yaml.Marshal(pr.Spec)
			if err != nil {
				return nil, fmt.Errorf("the PrometheusRule's spec: %w", err)
			}
			rules = b
		}
		switch {
		case o.Hook != "":
			setup = append(setup, o)
		case o.APIVersion == "monitoring.coreos.com/v1" || o.Source == "kvmapper/templates/dashboard.yaml":
			monitoring = append(monitoring, o)
		default:
			replicas = append(replicas, o)
		}
	}
	header := func(what, apply string) string {
		return what + "\n" +
			"Rendered from the chart deploy/helm/kvmapper with deploy/kubernetes/values.yaml by\n" +
			"`go -C deploy run ./cmd/render`: edit those, not this file. Release \"" + PlainRelease.Name + "\", namespace \"" + PlainRelease.Namespace + "\".\n" +
			apply
	}
	if rules == nil {
		return nil, fmt.Errorf("%s renders no PrometheusRule (metrics.prometheusRule.enabled), whose spec is the plain rule file", valuesFile)
	}
	rulesHeader := "kvmapper's alert rules, a plain Prometheus rule file (rule_files: in prometheus.yml;\n" +
		"promtool check rules kvmapper-rules.yaml), for Prometheus outside the prometheus-operator.\n" +
		"Rendered from the chart deploy/helm/kvmapper (files/kvmapper-rules.yaml, with the thresholds of\n" +
		"its values.yaml) by `go -C deploy run ./cmd/render`: edit those, not this file. The replicas'\n" +
		"scrape job must be named " + strconv.Quote(job) + " (job_name: the rules select up{job=...}).\n" +
		"docs/deploy-alerts.md says what each alert means."
	var rb bytes.Buffer
	for _, l := range strings.Split(rulesHeader, "\n") {
		rb.WriteString("# " + l + "\n")
	}
	rb.Write(rules)
	return map[string][]byte{
		"prometheus/kvmapper-rules.yaml": rb.Bytes(),
		"kubernetes/kvmapper.yaml": Write(replicas, header("kvmapper replicas: Deployment, ServiceAccount, metrics Service, PodDisruptionBudget.",
			"kubectl create namespace kvmapper; kubectl -n kvmapper apply -f kvmapper.yaml (docs/deploy-kubernetes.md).")),
		"kubernetes/setup-job.yaml": Write(setup, header("The one-shot `kvmapper setup` Job (a pre-install/pre-upgrade hook in the chart).",
			"Apply it before kvmapper.yaml and wait for it: kubectl -n kvmapper apply -f setup-job.yaml &&\nkubectl -n kvmapper wait --for=condition=complete job/kvmapper-setup; delete it before applying it again.")),
		"kubernetes/monitoring.yaml": Write(monitoring, header("Monitoring: ServiceMonitor and PrometheusRule (prometheus-operator CRDs) and the Grafana dashboard.",
			"kubectl -n kvmapper apply -f monitoring.yaml")),
	}, nil
}
