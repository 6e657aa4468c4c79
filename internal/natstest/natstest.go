// Package natstest starts embedded NATS servers with JetStream for tests, in the manner of
// net/http/httptest: each server listens on a random loopback port, keeps its JetStream data in a
// test's temporary directory and is shut down by t.Cleanup. It leaves the choice of streams and
// buckets to the tests.
package natstest

import (
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Server is a running embedded NATS server with JetStream.
type Server struct {
	*server.Server
	// Opts are the options the server was started with; Restart reuses them.
	Opts *server.Options
	t    testing.TB
}

// Options returns the options Start uses: JetStream on, random loopback port, data in dir.
func Options(dir string) *server.Options {
	return &server.Options{
		Host:      "127.0.0.1",
		Port:      -1,
		JetStream: true,
		StoreDir:  dir,
		NoLog:     true,
		NoSigs:    true,
		// Generous limits: tests fill streams quickly on a shared 2-core machine.
		MaxPayload: 1 << 20,
	}
}

// Start starts a server with [Options] and a fresh temporary store directory, and registers its
// shutdown with t.Cleanup. Optional funcs may change the options before the server starts.
func Start(t testing.TB, mods ...func(*server.Options)) *Server {
	t.Helper()
	opts := Options(t.TempDir())
	for _, m := range mods {
		m(opts)
	}
	return StartWith(t, opts)
}

// StartWith starts a server with the given options and registers its shutdown with t.Cleanup.
func StartWith(t testing.TB, opts *server.Options) *Server {
	t.Helper()
	s, err := server.NewServer(opts)
	if err != nil {
		t.Fatalf("server.NewServer: %v", err)
	}
	s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		s.Shutdown()
		t.Fatalf("nats server not ready within 10s")
	}
	srv := &Server{Server: s, Opts: opts, t: t}
	t.Cleanup(srv.Stop)
	return srv
}

// Stop shuts the server down and waits until it has stopped. It is safe to call more than once.
func (s *Server) Stop() {
	s.Server.Shutdown()
	s.Server.WaitForShutdown()
}

// Restart stops the server and starts a new one on the same port with the same store directory,
// as an operator restarting nats-server would. The returned Server replaces s.
func (s *Server) Restart() *Server {
	s.t.Helper()
	port := s.Port()
	s.Stop()
	opts := *s.Opts
	opts.Port = port
	return StartWith(s.t, &opts)
}

// Port returns the client port the server listens on.
func (s *Server) Port() int {
	return s.Addr().(*net.TCPAddr).Port
}

// URL returns the nats:// URL of the server's client port.
func (s *Server) URL() string {
	return fmt.Sprintf("nats://127.0.0.1:%d", s.Port())
}

// Connect dials the server over loopback TCP and closes the connection with t.Cleanup.
func (s *Server) Connect(t testing.TB, opts ...nats.Option) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(s.URL(), opts...)
	if err != nil {
		t.Fatalf("nats.Connect(%s): %v", s.URL(), err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// JetStream connects to the server and returns a JetStream context on that connection.
func (s *Server) JetStream(t testing.TB, opts ...nats.Option) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc := s.Connect(t, opts...)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatalf("jetstream.New: %v", err)
	}
	return nc, js
}

// Eventually calls f every tick until it returns nil or the timeout passes, then fails the test
// with f's last error. It is the tests' only way to wait for a state that arrives asynchronously.
func Eventually(t testing.TB, timeout time.Duration, f func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	tick := 10 * time.Millisecond
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("condition not met within %v: %v", timeout, err)
		}
		timer := time.NewTimer(tick)
		<-timer.C
		if tick < 200*time.Millisecond {
			tick *= 2
		}
	}
}
