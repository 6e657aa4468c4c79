package integration

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// netLab is a network the test builds with Linux network namespaces, to cut links that loopback
// cannot: each host (a NATS server, a replica) is a namespace of its own, plugged by a veth pair
// into a bridge in a switch namespace, on a /24 of 10.0.0.0/8 the lab draws at random; the test
// process itself is one more host, through a veth in its own namespace. Every name starts with a
// prefix drawn for the test run, so that runs never share anything; t.Cleanup kills the processes
// and deletes the namespaces (and with them every veth), also when the test fails. It needs
// root (CAP_NET_ADMIN) and iproute2's ip command, and runs only with KVMAPPER_NETNS=1, which CI sets.
//
// Nothing is routed beyond the lab: the namespaces have no default route, and the test's own
// veth only carries the lab's /24.
type netLab struct {
	t      *testing.T
	prefix string // e.g. "k3f9a": names are <prefix><role>
	net    string // "10.a.b."
	sw     string // the switch namespace
	hosts  map[string]*labHost
	next   int // the next host number (address .next)
	mu     sync.Mutex
	procs  []*labProc
}

// labHost is one namespace of the lab and its address.
type labHost struct {
	name, ns, ip string
	peer         string // its veth's end on the bridge, in the switch namespace
}

// netnsEnv is the environment variable that turns the network-namespace tests on. They build
// namespaces, veths and a bridge on the machine they run on and take about three minutes, so a
// plain `go test ./...` leaves them out, also as root; CI sets it (.ci/run), and then a machine
// that cannot run them fails them loudly instead.
const netnsEnv = "KVMAPPER_NETNS"

// requireNetns skips the test unless KVMAPPER_NETNS=1, with one line saying how to run it; with
// it set, it fails the test unless the process is root and has iproute2's ip command.
func requireNetns(t *testing.T) {
	t.Helper()
	if os.Getenv(netnsEnv) != "1" {
		t.Skipf("network-namespace test: run it as root with %s=1 (needs only iproute2's ip; CI sets it)", netnsEnv)
	}
	if os.Geteuid() != 0 {
		t.Fatalf("%s=1, but the network tests need root (CAP_NET_ADMIN) to create network namespaces", netnsEnv)
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Fatalf("%s=1, but the network tests need iproute2's ip command (Debian: apt-get install iproute2): %v", netnsEnv, err)
	}
}

var (
	labStart sync.Once
	labBase  [2]byte
	labNet   int
	labSeq   atomic.Int64
)

// newNetLab builds the switch and the test's own host, and registers the teardown. It skips the
// test unless KVMAPPER_NETNS=1 (requireNetns).
func newNetLab(t *testing.T) *netLab {
	t.Helper()
	requireNetns(t)
	// Labs run side by side (t.Parallel): the ones of one test process take consecutive /24s
	// and names from a start drawn at random, so that they never share one, and two test
	// processes on one machine almost never do.
	labStart.Do(func() {
		_, _ = rand.Read(labBase[:])
		n, _ := rand.Int(rand.Reader, big.NewInt(50*250))
		labNet = int(n.Int64())
	})
	seq := int(labSeq.Add(1))
	n := (labNet + seq) % (50 * 250)
	l := &netLab{t: t, prefix: "k" + hex.EncodeToString(labBase[:]) + strconv.Itoa(seq), hosts: map[string]*labHost{}, next: 1,
		net: fmt.Sprintf("10.%d.%d.", 200+n/250, 1+n%250)}
	l.sw = l.prefix + "sw"
	t.Cleanup(l.teardown)
	l.ip("netns", "add", l.sw)
	l.ip("-n", l.sw, "link", "add", "br0", "type", "bridge")
	l.ip("-n", l.sw, "link", "set", "br0", "up")
	l.ip("-n", l.sw, "link", "set", "lo", "up")
	// The test process's own host: a veth from this namespace to the bridge.
	me := l.prefix + "t"
	l.ip("link", "add", me, "type", "veth", "peer", "name", me+"b", "netns", l.sw)
	l.ip("addr", "add", l.net+"254/24", "dev", me)
	l.ip("link", "set", me, "up")
	l.ip("-n", l.sw, "link", "set", me+"b", "master", "br0")
	l.ip("-n", l.sw, "link", "set", me+"b", "up")
	t.Logf("network lab %s on %s0/24", l.prefix, l.net)
	return l
}

// host creates the host called name (a short role: s0, r1…) with the lab's next address.
func (l *netLab) host(name string) *labHost {
	l.t.Helper()
	h := &labHost{name: name, ns: l.prefix + name, ip: l.net + strconv.Itoa(l.next), peer: l.prefix + name + "b"}
	l.next++
	l.ip("netns", "add", h.ns)
	l.ip("-n", h.ns, "link", "set", "lo", "up")
	l.ip("-n", l.sw, "link", "add", h.peer, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
	l.ip("-n", l.sw, "link", "set", h.peer, "master", "br0")
	l.ip("-n", l.sw, "link", "set", h.peer, "up")
	l.ip("-n", h.ns, "addr", "add", h.ip+"/24", "dev", "eth0")
	l.ip("-n", h.ns, "link", "set", "eth0", "up")
	l.hosts[name] = h
	return h
}

// cut unplugs host h from the switch, as a pulled cable would: nothing reaches it or leaves it,
// and no connection of it is told. heal plugs it back.
func (l *netLab) cut(h *labHost)  { l.t.Helper(); l.ip("-n", l.sw, "link", "set", h.peer, "down") }
func (l *netLab) heal(h *labHost) { l.t.Helper(); l.ip("-n", l.sw, "link", "set", h.peer, "up") }

// block drops everything between hosts a and b, both ways: one route lost while both reach
// everyone else. unblock restores it. It is a blackhole route to the other's address in each of
// the two namespaces: whatever either sends the other is discarded on the way out, silently, as a
// lost link does (a connection already open hears nothing more; the kernel drops its segments and
// retransmits them until the route is back), and nothing crosses either way. Only iproute2 is
// needed. A route changed invalidates the routes sockets have cached, so it strikes at once.
// (Dropping on arrival alone, a policy rule in one namespace, cut only one direction and struck
// less: TestNetLostRoute saw no takeover in five tries.)
func (l *netLab) block(a, b *labHost) {
	l.t.Helper()
	l.ip("-n", a.ns, "route", "add", "blackhole", b.ip+"/32")
	l.ip("-n", b.ns, "route", "add", "blackhole", a.ip+"/32")
}

func (l *netLab) unblock(a, b *labHost) {
	l.t.Helper()
	l.ip("-n", a.ns, "route", "del", "blackhole", b.ip+"/32")
	l.ip("-n", b.ns, "route", "del", "blackhole", a.ip+"/32")
}

// labProc is a process the lab runs in one of its hosts.
type labProc struct {
	name string
	cmd  *exec.Cmd
	logs *logBuf
	done chan struct{}
	err  error
}

// start runs bin with args in host h (ip netns exec), its output in the returned process's logs.
func (l *netLab) start(h *labHost, name, bin string, args ...string) *labProc {
	l.t.Helper()
	p := &labProc{name: name, logs: &logBuf{}, done: make(chan struct{})}
	p.cmd = exec.Command("ip", append([]string{"netns", "exec", h.ns, bin}, args...)...)
	p.cmd.Stdout, p.cmd.Stderr = p.logs, p.logs
	if err := p.cmd.Start(); err != nil {
		l.t.Fatalf("starting %s in %s: %v", name, h.ns, err)
	}
	go func() { p.err = p.cmd.Wait(); close(p.done) }()
	l.mu.Lock()
	l.procs = append(l.procs, p)
	l.mu.Unlock()
	return p
}

// signal sends sig to the process (ip netns exec execs it: the pid is the program's).
func (p *labProc) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		t.Fatalf("signal %v to %s: %v", sig, p.name, err)
	}
}

// wait waits for the process to exit, at most timeout.
func (p *labProc) wait(t *testing.T, timeout time.Duration) {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(timeout):
		t.Fatalf("%s did not exit within %v", p.name, timeout)
	}
}

// teardown kills every process and deletes every namespace of the lab.
func (l *netLab) teardown() {
	l.mu.Lock()
	procs := l.procs
	l.mu.Unlock()
	for _, p := range procs {
		select {
		case <-p.done:
		default:
			_ = p.cmd.Process.Signal(syscall.SIGKILL)
			<-p.done
		}
		// KVM_LAB_DUMP=<dir> keeps every lab process's whole log there, for a developer
		// reading a run (the failure report shows only the last lines).
		if d := os.Getenv("KVM_LAB_DUMP"); d != "" {
			_ = os.WriteFile(d+"/"+p.name+".log", []byte(p.logs.String()), 0o644)
		}
		if l.t.Failed() {
			l.t.Logf("last lines of %s:\n%s", p.name, p.logs.tail(40))
		}
		if dir := os.Getenv("KVMAPPER_TEST_LOGDIR"); dir != "" {
			_ = os.WriteFile(filepath.Join(dir, l.prefix+"-"+p.name+".log"), []byte(p.logs.String()), 0o644)
		}
	}
	for _, h := range l.hosts {
		_ = exec.Command("ip", "netns", "del", h.ns).Run()
	}
	_ = exec.Command("ip", "link", "del", l.prefix+"t").Run()
	_ = exec.Command("ip", "netns", "del", l.sw).Run()
}

func (l *netLab) ip(args ...string) {
	l.t.Helper()
	l.run("ip", args...)
}

func (l *netLab) run(name string, args ...string) {
	l.t.Helper()
	var out bytes.Buffer
	cmd := exec.Command(name, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		l.t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out.String())
	}
}

// natsServerBin builds nats-server at the version go.mod pins, from the module cache, once per
// test binary, beside the kvmapper binary (the README's cluster recipe builds it the same way).
var natsServerBin = sync.OnceValues(func() (string, error) {
	out := filepath.Join(filepath.Dir(bin), "nats-server") // TestMain removes the directory

	cmd := exec.Command("go", "build", "-o", out, "github.com/nats-io/nats-server/v2")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("building nats-server: %w\n%s", err, b)
	}
	return out, nil
})
