package natsconn

import (
	"time"

	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"
)

// Exported for the black-box tests: the helpers behind the error handler of [Dial].
var (
	GrantFor   = grantFor
	RedactURLs = redactURLs
)

// LogLimiter is logLimiter, for the tests.
type LogLimiter = logLimiter

// NewLogLimiter returns a limiter that lets one line per kind through every interval.
func NewLogLimiter(every time.Duration) *LogLimiter { return &logLimiter{every: every} }

// AllowAt is allowAt, for the tests.
func (l *logLimiter) AllowAt(kind string, now time.Time) (int, bool) { return l.allowAt(kind, now) }

// AsyncError is asyncError, for the tests.
func AsyncError(log zerolog.Logger, limit *LogLimiter, sub *nats.Subscription, err error) {
	asyncError(log, limit, sub, err)
}
