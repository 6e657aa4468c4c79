package embedded

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// ErrInvalidListen is wrapped by [Start]'s error for a listen address that is not host:port.
var ErrInvalidListen = errors.New("embedded: invalid listen address")

// Config says how to start the server. Zero fields mean the defaults given.
type Config struct {
	// Listen is the host:port the server accepts clients on; port -1 picks a free one.
	// Required.
	Listen string
	// Dir holds the JetStream data. Required.
	Dir string
	// Mappings are the global account's subject mappings (source → destination), as a
	// `mappings` block of a server configuration file gives them.
	Mappings map[string]string
	// Name is the server's name. Default "kvmapper-embedded".
	Name string
	// ReadyTimeout is how long [Start] waits for the server to accept connections. Default 10s.
	ReadyTimeout time.Duration
	// Cluster, if set, makes the server a node of a JetStream cluster (the bench's 3-node runs:
	// `kvmapper bench --cluster 3`). Each node needs a distinct Name.
	Cluster *Cluster
}

// Cluster is a node's place in a cluster: the cluster's name, the host:port it accepts routes
// on, and the routes (nats-route://host:port) to every node, itself included, as a
// nats-server configuration's cluster block gives them.
type Cluster struct {
	Name   string
	Listen string
	Routes []string
}

// Server is a running embedded NATS server with JetStream. Its methods are safe for concurrent
// use.
type Server struct {
	srv *server.Server
}

// Start starts a server as cfg says and returns once it accepts connections. It fails wrapping
// [ErrInvalidListen] for a bad cfg.Listen.
func Start(cfg Config) (*Server, error) {
	host, port, err := net.SplitHostPort(cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("%w: %q: want host:port (%v)", ErrInvalidListen, cfg.Listen, err)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < -1 || p > 65535 {
		return nil, fmt.Errorf("%w: %q: bad port", ErrInvalidListen, cfg.Listen)
	}
	if cfg.Name == "" {
		cfg.Name = "kvmapper-embedded"
	}
	if cfg.ReadyTimeout == 0 {
		cfg.ReadyTimeout = 10 * time.Second
	}
	opts := &server.Options{
		ServerName: cfg.Name,
		Host:       host,
		Port:       p,
		JetStream:  true,
		StoreDir:   cfg.Dir,
		NoSigs:     true,
	}
	if c := cfg.Cluster; c != nil {
		if err := clusterOpts(opts, c); err != nil {
			return nil, err
		}
	}
	if len(cfg.Mappings) > 0 {
		// What the server does with a top-level mappings block: the global account, configured
		// before the server accepts a connection.
		gacc := server.NewAccount(server.DEFAULT_GLOBAL_ACCOUNT)
		for src, dest := range cfg.Mappings {
			if err := gacc.AddMapping(src, dest); err != nil {
				return nil, fmt.Errorf("embedded NATS server: mapping %s → %s: %w", src, dest, err)
			}
		}
		opts.Accounts = []*server.Account{gacc}
	}
	srv, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("starting embedded NATS server: %w", err)
	}
	srv.Start()
	if !srv.ReadyForConnections(cfg.ReadyTimeout) {
		srv.Shutdown()
		return nil, fmt.Errorf("embedded NATS server did not listen on %s within %v (is the port taken? use --listen)", cfg.Listen, cfg.ReadyTimeout)
	}
	return &Server{srv: srv}, nil
}

// URL is the address clients reach the server on, such as nats://127.0.0.1:4222.
func (s *Server) URL() string { return s.srv.ClientURL() }

// AddMapping adds a subject mapping to the global account of the running server: messages
// published after it returns are mapped.
func (s *Server) AddMapping(src, dest string) error {
	if err := s.srv.GlobalAccount().AddMapping(src, dest); err != nil {
		return fmt.Errorf("embedded NATS server: mapping %s → %s: %w", src, dest, err)
	}
	return nil
}

// Shutdown stops the server and waits until it has. Later calls do nothing.
func (s *Server) Shutdown() {
	s.srv.Shutdown()
	s.srv.WaitForShutdown()
}

// clusterOpts sets the cluster block of opts from c.
func clusterOpts(opts *server.Options, c *Cluster) error {
	host, port, err := net.SplitHostPort(c.Listen)
	if err != nil {
		return fmt.Errorf("%w: cluster listen %q: want host:port (%v)", ErrInvalidListen, c.Listen, err)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < 1 || p > 65535 {
		return fmt.Errorf("%w: cluster listen %q: bad port", ErrInvalidListen, c.Listen)
	}
	opts.Cluster = server.ClusterOpts{Name: c.Name, Host: host, Port: p}
	for _, r := range c.Routes {
		u, err := url.Parse(r)
		if err != nil {
			return fmt.Errorf("%w: route %q: %v", ErrInvalidListen, r, err)
		}
		opts.Routes = append(opts.Routes, u)
	}
	return nil
}
