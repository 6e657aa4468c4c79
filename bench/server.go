package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvmapper/kvmapper/internal/embedded"
	"github.com/kvmapper/kvmapper/setup"
	"github.com/kvmapper/kvmapper/subjects"
)

// ServerConfig is the NATS server the bench starts for itself, as a child process of its own
// so that the server's CPU time is its own and the bench can read it: `kvmapper server`, which
// runs [Serve]. Zero fields mean the defaults given.
type ServerConfig struct {
	// Listen is the host:port to listen on. Default 127.0.0.1:-1 (a free port).
	Listen string
	// Dir holds the JetStream data. Default for [StartServer]: a temporary directory, removed by
	// [ChildServer.Stop]. Required by [Serve].
	Dir string
	// CPUProfile, if set, is the file a CPU profile of the server is written to, taken between
	// the SIGUSR1 and SIGUSR2 the bench sends it ([ChildServer.Profile]).
	CPUProfile string
	// StreamLayout and Partitions: with [subjects.PartitionStreams], the server gets the account
	// mapping of that layout for Partitions partitions (default 16) of the In template (default
	// incoming.{device}.{event}).
	StreamLayout subjects.StreamLayout
	Partitions   int
	In           string
	// DirectIn, if set, is a subject template the server also maps into partitions, as direct
	// mode's mapping receive kind needs (the bench's direct run: [DirectMappedIn]).
	DirectIn string
	// Nodes, when more than one, makes [StartCluster] start that many servers in one cluster
	// (three is nats-server's smallest that survives losing one), every stream at
	// min(Nodes, 3) replicas: the production default. [StartServer] ignores it.
	Nodes int
	// Name, ClusterName, ClusterListen and Routes place one server in a cluster ([Serve]);
	// [StartCluster] sets them for each node.
	Name, ClusterName, ClusterListen string
	Routes                           []string
}

func (c *ServerConfig) setDefaults() {
	if c.Listen == "" {
		c.Listen = "127.0.0.1:-1"
	}
	if c.Partitions == 0 {
		c.Partitions = 16
	}
	if c.In == "" {
		c.In = inTemplate
	}
	if c.StreamLayout == "" {
		c.StreamLayout = subjects.SingleStream
	}
}

// Serve runs the bench's server until ctx ends: it prints the server's URL on w once the server
// accepts connections, and with cfg.CPUProfile profiles the server between a SIGUSR1 and a
// SIGUSR2. A bad configuration is an error wrapping [ErrInvalidConfig].
func Serve(ctx context.Context, cfg ServerConfig, w io.Writer) error {
	cfg.setDefaults()
	lay, err := subjects.NewLayout(cfg.In, outTemplate, unmappedTemplate, cfg.Partitions)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	maps := setup.Config{Layout: lay, Names: subjects.Names{StreamLayout: cfg.StreamLayout}}.ServerMappings()
	if cfg.DirectIn != "" {
		dlay, err := subjects.NewLayout(cfg.DirectIn, outTemplate, unmappedTemplate, cfg.Partitions)
		if err != nil {
			return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
		}
		if maps == nil {
			maps = map[string]string{}
		}
		maps[dlay.MappingSource()] = dlay.MappingDest()
	}
	prof := make(chan os.Signal, 1)
	if cfg.CPUProfile != "" {
		signal.Notify(prof, syscall.SIGUSR1, syscall.SIGUSR2)
		defer signal.Stop(prof)
	}
	ec := embedded.Config{Listen: cfg.Listen, Dir: cfg.Dir, Mappings: maps, Name: cfg.Name}
	if cfg.ClusterListen != "" {
		ec.Cluster = &embedded.Cluster{Name: cfg.ClusterName, Listen: cfg.ClusterListen, Routes: cfg.Routes}
	}
	srv, err := embedded.Start(ec)
	if errors.Is(err, embedded.ErrInvalidListen) {
		return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	if err != nil {
		return err
	}
	defer srv.Shutdown()
	fmt.Fprintln(w, srv.URL())

	var f *os.File
	defer func() {
		if f != nil {
			pprof.StopCPUProfile()
			f.Close()
		}
	}()
	for {
		select {
		case <-ctx.Done():
			return nil
		case s := <-prof:
			switch {
			case s == syscall.SIGUSR1 && f == nil:
				if f, err = os.Create(cfg.CPUProfile); err != nil {
					return err
				}
				if err := pprof.StartCPUProfile(f); err != nil {
					return err
				}
			case s == syscall.SIGUSR2 && f != nil:
				pprof.StopCPUProfile()
				err := f.Close()
				f = nil
				if err != nil {
					return err
				}
			}
		}
	}
}

// ChildServer is the bench's server running as a child process ([StartServer]).
type ChildServer struct {
	cmd  *exec.Cmd
	url  string
	dir  string // removed on stop when the bench made it
	done chan struct{}
}

// StartServer starts `exe server`, exe being a kvmapper binary, as cfg says, and returns once it
// accepts connections (at most 30s). [ChildServer.Stop] stops it.
func StartServer(ctx context.Context, exe string, cfg ServerConfig) (*ChildServer, error) {
	cfg.setDefaults()
	s := &ChildServer{done: make(chan struct{})}
	if cfg.Dir == "" {
		d, err := os.MkdirTemp("", "kvmapper-bench-")
		if err != nil {
			return nil, err
		}
		cfg.Dir, s.dir = d, d
	}
	args := []string{"server", "--listen", cfg.Listen, "--data-dir", cfg.Dir, "--layout", string(cfg.StreamLayout),
		"--partitions", strconv.Itoa(cfg.Partitions), "--in", cfg.In}
	if cfg.DirectIn != "" {
		args = append(args, "--direct-in", cfg.DirectIn)
	}
	if cfg.CPUProfile != "" {
		args = append(args, "--cpuprofile", cfg.CPUProfile)
	}
	if cfg.ClusterListen != "" {
		args = append(args, "--name", cfg.Name, "--cluster-name", cfg.ClusterName, "--cluster-listen", cfg.ClusterListen,
			"--routes", strings.Join(cfg.Routes, ","))
	}
	s.cmd = exec.Command(exe, args...)
	s.cmd.Stderr = os.Stderr
	out, err := s.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := s.cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting the NATS server: %w", err)
	}
	// The server prints its URL once it accepts connections.
	urlc := make(chan string, 1)
	go func() {
		defer close(s.done)
		sc := bufio.NewScanner(out)
		if sc.Scan() {
			urlc <- strings.TrimSpace(sc.Text())
		}
		_, _ = io.Copy(io.Discard, out)
		_ = s.cmd.Wait()
	}()
	t := time.NewTimer(30 * time.Second)
	defer t.Stop()
	select {
	case s.url = <-urlc:
		return s, nil
	case <-s.done:
		err = errors.New("the NATS server exited before it listened")
	case <-t.C:
		err = errors.New("the NATS server did not listen within 30s")
	case <-ctx.Done():
		err = ctx.Err()
	}
	s.Stop()
	return nil, err
}

// URL is the address the server accepts clients on.
func (s *ChildServer) URL() string { return s.url }

// PIDs is the server's process id, alone ([Config.ServerPIDs]).
func (s *ChildServer) PIDs() []int { return []int{s.cmd.Process.Pid} }

// Profile starts (true) or ends (false) the server's CPU profile ([Config.ServerProfile]); the
// server was started with [ServerConfig.CPUProfile].
func (s *ChildServer) Profile(start bool) {
	sig := syscall.SIGUSR2
	if start {
		sig = syscall.SIGUSR1
	}
	_ = s.cmd.Process.Signal(sig)
}

// Stop stops the server with SIGTERM (SIGKILL after 30s), waits for it and removes its data
// when the bench made the directory.
func (s *ChildServer) Stop() {
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	t := time.NewTimer(30 * time.Second)
	select {
	case <-s.done:
	case <-t.C:
		_ = s.cmd.Process.Kill()
		<-s.done
	}
	t.Stop()
	if s.dir != "" {
		os.RemoveAll(s.dir)
	}
}

// ReplicaCommand is the [ChildFunc] of a kvmapper binary exe: `exe run` against the bench's
// streams and buckets, so that the failover bench kills a real replica process.
func ReplicaCommand(exe string) ChildFunc {
	return func(url, id string, n Names) *exec.Cmd {
		return exec.Command(exe, "run", "--server", url, "--replica-id", id,
			"--partitions", strconv.Itoa(n.Partitions),
			"--incoming-stream", n.Incoming, "--outgoing-stream", n.Outgoing, "--unmapped-stream", n.Unmapped,
			"--groups-bucket", n.Groups, "--control-bucket", n.Control, "--layout", string(n.StreamLayout),
			"--log-level", "warn", "--log-format", "json")
	}
}

// Servers are the bench's own servers: one ([ChildServer]) or a cluster ([ChildCluster]).
type Servers interface {
	// URL is what a client connects to: every server's address, comma-separated.
	URL() string
	// PIDs are the servers' process ids ([Config.ServerPIDs]).
	PIDs() []int
	// Profile starts or ends every server's CPU profile ([Config.ServerProfile]).
	Profile(start bool)
	// Stop stops every server and removes the data the bench made.
	Stop()
}

// ChildCluster is the bench's cluster of child servers ([StartCluster]).
type ChildCluster struct {
	nodes []*ChildServer
}

// StartCluster starts cfg.Nodes child servers ([StartServer]) as one JetStream cluster on
// loopback, named n1…, each with a data directory of its own (under cfg.Dir when given) and, with
// cfg.CPUProfile, a profile of its own (FILE.n1…). It returns once the cluster has a JetStream
// meta leader (at most 60s).
func StartCluster(ctx context.Context, exe string, cfg ServerConfig) (*ChildCluster, error) {
	if cfg.Nodes < 2 {
		return nil, fmt.Errorf("%w: a cluster needs at least 2 nodes, not %d", ErrInvalidConfig, cfg.Nodes)
	}
	ports, err := freePorts(cfg.Nodes)
	if err != nil {
		return nil, err
	}
	var routes []string
	for _, p := range ports {
		routes = append(routes, fmt.Sprintf("nats-route://127.0.0.1:%d", p))
	}
	c := &ChildCluster{}
	for i, p := range ports {
		n := cfg
		n.Name, n.ClusterName, n.Routes = fmt.Sprintf("n%d", i+1), "kvmapper-bench", routes
		n.ClusterListen = fmt.Sprintf("127.0.0.1:%d", p)
		if cfg.Dir != "" {
			n.Dir = filepath.Join(cfg.Dir, n.Name)
		}
		if cfg.CPUProfile != "" {
			n.CPUProfile = cfg.CPUProfile + "." + n.Name
		}
		s, err := StartServer(ctx, exe, n)
		if err != nil {
			c.Stop()
			return nil, fmt.Errorf("starting cluster node %s: %w", n.Name, err)
		}
		c.nodes = append(c.nodes, s)
	}
	if err := c.waitMeta(ctx, 60*time.Second); err != nil {
		c.Stop()
		return nil, err
	}
	return c, nil
}

// freePorts finds n ports free on 127.0.0.1 for the cluster's routes, which every node must
// know before any starts.
func freePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	var ports []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("finding a free port for a cluster route: %w", err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// waitMeta waits until JetStream answers an account info request: the meta group has a leader.
func (c *ChildCluster) waitMeta(ctx context.Context, limit time.Duration) error {
	nc, err := nats.Connect(c.URL(), nats.Name("kvmapper bench cluster check"))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	deadline := time.Now().Add(limit)
	for {
		actx, cancel := context.WithTimeout(ctx, 2*time.Second)
		_, err := js.AccountInfo(actx)
		cancel()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the cluster's JetStream did not answer within %v: %w", limit, err)
		}
		t := time.NewTimer(100 * time.Millisecond)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		}
	}
}

// URL is every node's client address, comma-separated, as nats.Connect takes them.
func (c *ChildCluster) URL() string {
	var urls []string
	for _, n := range c.nodes {
		urls = append(urls, n.URL())
	}
	return strings.Join(urls, ",")
}

// PIDs are the nodes' process ids.
func (c *ChildCluster) PIDs() []int {
	var pids []int
	for _, n := range c.nodes {
		pids = append(pids, n.PIDs()...)
	}
	return pids
}

// Profile starts or ends every node's CPU profile.
func (c *ChildCluster) Profile(start bool) {
	for _, n := range c.nodes {
		n.Profile(start)
	}
}

// Stop stops every node.
func (c *ChildCluster) Stop() {
	for _, n := range c.nodes {
		n.Stop()
	}
}
