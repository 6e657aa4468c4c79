// Package natstest starts embedded NATS servers with JetStream for tests, in the manner of
// net/http/httptest: each server listens on a random loopback port, keeps its JetStream data in a
// test's temporary directory and is shut down by t.Cleanup. It leaves the choice of streams and
// buckets to the tests.
package natstest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
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

// TLS returns an option func for [Start] that makes the server require TLS, with a certificate
// for 127.0.0.1 and localhost signed by a certificate authority made for this test, and the path
// of a PEM file holding that authority's certificate (what a client passes as its CA file).
// Nothing is read from or left outside t.TempDir().
func TLS(t testing.TB) (func(*server.Options), string) {
	t.Helper()
	key := func() *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatalf("ecdsa.GenerateKey: %v", err)
		}
		return k
	}
	now := time.Now()
	caKey := key()
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "natstest CA"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatalf("creating CA certificate: %v", err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatalf("parsing CA certificate: %v", err)
	}
	srvKey := key()
	srvDER, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: "127.0.0.1"},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		DNSNames:     []string{"localhost"},
	}, ca, &srvKey.PublicKey, caKey)
	if err != nil {
		t.Fatalf("creating server certificate: %v", err)
	}
	caFile := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := &tls.Config{
		MinVersion:   tls.VersionTLS12,
		Certificates: []tls.Certificate{{Certificate: [][]byte{srvDER}, PrivateKey: srvKey}},
	}
	return func(o *server.Options) {
		o.TLS = true
		o.TLSConfig = cfg
		o.TLSTimeout = 5
	}, caFile
}
