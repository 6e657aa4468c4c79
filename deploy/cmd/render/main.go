// Command render writes the plain Kubernetes manifests of deploy/kubernetes/, for users without
// Helm, and the plain Prometheus rule file, from the chart and deploy/kubernetes/values.yaml:
//
//	go -C deploy run ./cmd/render
//
// kvmapper.yaml holds the replicas (Deployment, ServiceAccount, metrics Service,
// PodDisruptionBudget), setup-job.yaml the one-shot `kvmapper setup` (a Helm hook in the chart),
// monitoring.yaml the ServiceMonitor, PrometheusRule and Grafana dashboard (prometheus-operator
// CRDs); and deploy/prometheus/kvmapper-rules.yaml, the alert rules as a plain Prometheus rule
// file. CI fails when they differ from what the chart renders.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/kvmapper/kvmapper/deploy/chart"
)

func main() {
	root := flag.String("root", ".", "the deploy module's directory")
	check := flag.Bool("check", false, "write nothing: fail when a file differs from what the chart renders")
	flag.Parse()
	if err := run(*root, *check); err != nil {
		fmt.Fprintf(os.Stderr, "render: %v\n", err)
		os.Exit(1)
	}
}

func run(root string, check bool) error {
	files, err := chart.Plain(root)
	if err != nil {
		return err
	}
	for name, data := range files {
		p := filepath.Join(root, filepath.FromSlash(name))
		if check {
			old, err := os.ReadFile(p)
			if err != nil || string(old) != string(data) {
				return fmt.Errorf("%s is not what the chart renders: run go -C deploy run ./cmd/render", p)
			}
			continue
		}
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(p, data, 0o644); err != nil {
			return err
		}
		fmt.Println("wrote", p)
	}
	return nil
}
