package check

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// pod runs one container of a rendered pod spec as the kubelet would, with the image's binary
// on this machine: the image's entrypoint with the container's args, its environment (field
// references and Secrets resolved), its Secret volumes written to files where it mounts them.
// Only what a pod's network and DNS give is replaced: the NATS URLs (KVMAPPER_SERVER) and the
// metrics address, which binds a free loopback port instead of the container's.
type pod struct {
	t         *testing.T
	name      string
	spec      corev1.PodSpec
	container corev1.Container
	args      []string
	env       []string
	// metricsPort is the container port the metrics listen on (from KVMAPPER_METRICS_LISTEN);
	// metricsAddr where they listen here.
	metricsPort int
	metricsAddr string
}

// newPod prepares container name of spec as pod podName. secrets holds the Secrets by name,
// each key's content; servers is what KVMAPPER_SERVER becomes.
func newPod(t *testing.T, podName string, spec corev1.PodSpec, container string, secrets map[string]map[string][]byte, servers string) *pod {
	t.Helper()
	p := &pod{t: t, name: podName, spec: spec}
	found := false
	for _, c := range spec.Containers {
		if c.Name == container {
			p.container, found = c, true
		}
	}
	if !found {
		t.Fatalf("pod %s has no container %q", podName, container)
	}
	c := p.container
	if len(c.Command) > 0 {
		t.Fatalf("container %s overrides the image's entrypoint with %q", c.Name, c.Command)
	}
	// Secret volumes, mounted where the container mounts them.
	root := t.TempDir()
	mounts := map[string]string{} // mountPath → directory here
	for _, m := range c.VolumeMounts {
		var vol *corev1.Volume
		for i := range spec.Volumes {
			if spec.Volumes[i].Name == m.Name {
				vol = &spec.Volumes[i]
			}
		}
		if vol == nil {
			t.Fatalf("container %s mounts volume %q, which the pod does not have", c.Name, m.Name)
		}
		if vol.Secret == nil {
			t.Fatalf("volume %q is not a Secret; the check knows only those", m.Name)
		}
		data, ok := secrets[vol.Secret.SecretName]
		if !ok {
			t.Fatalf("volume %q: no Secret %q in the test", m.Name, vol.Secret.SecretName)
		}
		dir := filepath.Join(root, m.Name)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		write := func(key, path string) {
			b, ok := data[key]
			if !ok {
				t.Fatalf("volume %q: Secret %q has no key %q", m.Name, vol.Secret.SecretName, key)
			}
			if err := os.WriteFile(filepath.Join(dir, path), b, 0o600); err != nil {
				t.Fatal(err)
			}
		}
		if len(vol.Secret.Items) > 0 {
			for _, it := range vol.Secret.Items {
				write(it.Key, it.Path)
			}
		} else {
			for k := range data {
				write(k, k)
			}
		}
		mounts[strings.TrimSuffix(m.MountPath, "/")] = dir
	}
	local := func(v string) string {
		for mp, dir := range mounts {
			if strings.HasPrefix(v, mp+"/") {
				return dir + strings.TrimPrefix(v, mp)
			}
		}
		return v
	}
	for _, e := range c.Env {
		v := e.Value
		switch {
		case e.ValueFrom == nil:
		case e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "metadata.name":
			v = podName
		case e.ValueFrom.SecretKeyRef != nil:
			ref := e.ValueFrom.SecretKeyRef
			b, ok := secrets[ref.Name][ref.Key]
			if !ok {
				t.Fatalf("env %s: no key %q in Secret %q", e.Name, ref.Key, ref.Name)
			}
			v = string(b)
		default:
			t.Fatalf("env %s: the check cannot resolve %+v", e.Name, e.ValueFrom)
		}
		switch e.Name {
		case "KVMAPPER_SERVER":
			v = servers
		case "KVMAPPER_METRICS_LISTEN":
			_, port, err := net.SplitHostPort(v)
			if err != nil {
				t.Fatalf("KVMAPPER_METRICS_LISTEN=%q: %v", v, err)
			}
			if p.metricsPort, err = strconv.Atoi(port); err != nil {
				t.Fatalf("KVMAPPER_METRICS_LISTEN=%q: %v", v, err)
			}
			p.metricsAddr = fmt.Sprintf("127.0.0.1:%d", freePort(t))
			v = p.metricsAddr
		}
		p.env = append(p.env, e.Name+"="+local(v))
	}
	for _, a := range c.Args {
		p.args = append(p.args, local(a))
	}
	return p
}

// port resolves a probe's port (a number or a container port's name) to a container port.
func (p *pod) port(port intstr.IntOrString) int {
	p.t.Helper()
	if port.Type == intstr.Int {
		return port.IntValue()
	}
	for _, cp := range p.container.Ports {
		if cp.Name == port.StrVal {
			return int(cp.ContainerPort)
		}
	}
	p.t.Fatalf("container %s has no port named %q", p.container.Name, port.StrVal)
	return 0
}

// probeURL is the URL here of a probe's httpGet, which must reach the metrics server.
func (p *pod) probeURL(pr *corev1.Probe) string {
	p.t.Helper()
	if pr == nil || pr.HTTPGet == nil {
		p.t.Fatalf("container %s: no httpGet probe", p.container.Name)
	}
	port := p.port(pr.HTTPGet.Port)
	if port != p.metricsPort {
		p.t.Fatalf("container %s: the probe asks port %d, but kvmapper serves /healthz and /readyz on %d (KVMAPPER_METRICS_LISTEN)", p.container.Name, port, p.metricsPort)
	}
	return "http://" + p.metricsAddr + pr.HTTPGet.Path
}

// start starts the container's process.
func (p *pod) start() *process {
	p.t.Helper()
	return start(p.t, p.name+"/"+p.container.Name, p.args, p.env)
}
