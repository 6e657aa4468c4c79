package status

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
	"github.com/rs/zerolog"
)

// ErrInvalidConfig is wrapped by the errors constructors return for an unusable argument.
var ErrInvalidConfig = errors.New("status: invalid config")

// ServiceConfig describes the replica a [Service] speaks for.
type ServiceConfig struct {
	// Replica is the replica id (member.<id>). Required.
	Replica string
	// Control is the control bucket's name; it is part of the endpoint subject. Required.
	Control string
	// Host is the machine's name, shown by kvmapper status and in the service metadata.
	Host string
	// Version is the replica's version; micro requires SemVer, so a version that is not
	// ("dev") is registered as "0.0.0-dev" while the metadata keeps it as given.
	Version string
	// Logger receives the service's errors. Default: none.
	Logger zerolog.Logger
}

// Service is one replica's instance of the "kvmapper" NATS micro service. Its status endpoint,
// on [StatusSubject], has no queue group: a request reaches exactly this replica, and
// `nats micro info|stats kvmapper` list every replica with its partitions.
type Service struct {
	nc      *nats.Conn
	report  func() Report
	cfg     ServiceConfig
	started time.Time
}

// NewService returns the service of one replica; report builds the answer to each status
// request (it is called from the connection's dispatch goroutine: it must not block). It does
// no I/O: [Service.Run] registers the service.
func NewService(nc *nats.Conn, report func() Report, cfg ServiceConfig) (*Service, error) {
	if nc == nil || report == nil {
		return nil, fmt.Errorf("%w: connection and report are required", ErrInvalidConfig)
	}
	if cfg.Replica == "" || cfg.Control == "" {
		return nil, fmt.Errorf("%w: replica id and control bucket are required", ErrInvalidConfig)
	}
	return &Service{nc: nc, report: report, cfg: cfg, started: time.Now()}, nil
}

// Run registers the service, answers until ctx is done, then unregisters it and returns nil.
// It returns an error if the service cannot be registered.
func (s *Service) Run(ctx context.Context) error {
	svc, err := micro.AddService(s.nc, micro.Config{
		Name:        ServiceName,
		Version:     microVersion(s.cfg.Version),
		Description: "kvmapper replica: republishes JetStream messages to subjects looked up in KV",
		Metadata: map[string]string{
			"replica":        s.cfg.Replica,
			"host":           s.cfg.Host,
			"version":        s.cfg.Version,
			"control_bucket": s.cfg.Control,
		},
		StatsHandler: func(*micro.Endpoint) any {
			r := s.Report()
			return map[string]any{"replica": r.Replica, "owned": r.Owned, "mapped": r.Counters.Mapped, "ready": r.Ready}
		},
		ErrorHandler: func(_ micro.Service, err *micro.NATSError) {
			s.cfg.Logger.Warn().Str("subject", err.Subject).Str("error", err.Description).Msg("status service error")
		},
	})
	if err != nil {
		return fmt.Errorf("status: registering micro service: %w", err)
	}
	subject := StatusSubject(s.cfg.Control, s.cfg.Replica)
	err = svc.AddEndpoint("status", micro.HandlerFunc(s.handle),
		micro.WithEndpointSubject(subject),
		micro.WithEndpointQueueGroupDisabled(),
		micro.WithEndpointMetadata(map[string]string{"replica": s.cfg.Replica, "format": "application/json"}))
	if err != nil {
		_ = svc.Stop()
		return fmt.Errorf("status: adding endpoint %s: %w", subject, err)
	}
	s.cfg.Logger.Info().Str("service", ServiceName).Str("subject", subject).Str("id", svc.Info().ID).Msg("status service registered")
	<-ctx.Done()
	if err := svc.Stop(); err != nil {
		s.cfg.Logger.Debug().Err(err).Msg("stopping status service")
	}
	return nil
}

// Report returns the replica's report now, with its identity and uptime filled in.
func (s *Service) Report() Report {
	r := s.report()
	r.Replica = s.cfg.Replica
	r.Host = s.cfg.Host
	r.Version = s.cfg.Version
	r.Started = s.started.UTC()
	r.UptimeSeconds = time.Since(s.started).Seconds()
	if r.Owned == nil {
		r.Owned = []int{}
	}
	if r.Partitions == nil {
		r.Partitions = []PartitionReport{}
	}
	return r
}

func (s *Service) handle(req micro.Request) {
	b, err := json.Marshal(s.Report())
	if err != nil {
		_ = req.Error("500", err.Error(), nil)
		return
	}
	_ = req.Respond(b)
}
