package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

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
	srv, err := embedded.Start(embedded.Config{Listen: cfg.Listen, Dir: cfg.Dir, Mappings: maps})
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

// PID is the server's process id ([Config.ServerPID]).
func (s *ChildServer) PID() int { return s.cmd.Process.Pid }

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
