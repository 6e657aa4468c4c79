package wire

import "errors"

// ErrInvalid is wrapped by the errors of the parsers of this package for a value that is not one
// of the names or formats they read.
var ErrInvalid = errors.New("wire: invalid value")
