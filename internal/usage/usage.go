// Package usage makes the errors kvmapper's packages return for a configuration value a user gave
// on the command line: each wraps its package's ErrInvalidConfig, so that callers test it with
// errors.Is, and reads as its message alone, in the command line's words ("invalid value 7 for
// flag --stream-replicas: must be 1 to 5"), so that package main shows it as it is, with exit
// code 2. Which values are wrong is left to each package's Config validation.
package usage

import "fmt"

type flagError struct{ sentinel, err error }

func (e flagError) Error() string   { return e.err.Error() }
func (e flagError) Unwrap() []error { return []error{e.sentinel, e.err} }

// Errorf returns an error that wraps sentinel and whatever format's %w verbs wrap, with the
// message of fmt.Errorf(format, a...).
func Errorf(sentinel error, format string, a ...any) error {
	return flagError{sentinel, fmt.Errorf(format, a...)}
}

// Value returns the error "invalid value V for flag --NAME: WHY", wrapping sentinel; a string V is
// quoted. why is a format of a.
func Value(sentinel error, name string, v any, why string, a ...any) error {
	if s, ok := v.(string); ok {
		v = fmt.Sprintf("%q", s)
	}
	return Errorf(sentinel, "invalid value %v for flag --%s: %s", v, name, fmt.Sprintf(why, a...))
}

// Also returns err, with its message, wrapping cause too: the error a parser returned, say, that
// err puts in the command line's words.
func Also(err, cause error) error { return flagError{cause, err} }
