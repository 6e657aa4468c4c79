package audit

import "errors"

var (
	// ErrInvalidConfig is wrapped by [Run]'s error for a [Config] it cannot run with.
	ErrInvalidConfig = errors.New("audit: invalid config")
	// ErrDirectMode is wrapped by [Run]'s error for a deployment in direct mode: there is no
	// INCOMING to audit the outputs against. The error's message says what to check instead.
	ErrDirectMode = errors.New("audit: direct mode has no INCOMING to audit against")
)
