package audit

import "errors"

// ErrInvalidConfig is wrapped by [Run]'s error for a [Config] it cannot run with.
var ErrInvalidConfig = errors.New("audit: invalid config")
