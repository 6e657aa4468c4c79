// Package metrics exports one replica's work to Prometheus from a private registry and serves it
// over HTTP with /healthz (the process is alive) and /readyz (connected and loaded). Counters the
// other packages already keep are read at scrape time through a [Source], so the hot path pays
// nothing; the few things that only exist as events (ownership changes, table updates) are
// recorded with the Observe methods. It leaves dialling NATS, and deciding what "ready" means, to
// the caller.
package metrics
