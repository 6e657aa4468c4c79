package natsconn

import (
	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/internal/ratelog"
)

// Exported for the black-box tests: the helpers behind the error handler of [Dial].
var (
	GrantFor   = grantFor
	RedactURLs = redactURLs
)

// AsyncError is asyncError, for the tests.
func AsyncError(log zerolog.Logger, limit *ratelog.Limiter, sub *nats.Subscription, err error) {
	asyncError(log, limit, sub, err)
}
