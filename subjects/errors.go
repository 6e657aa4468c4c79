package subjects

import "errors"

var (
	// ErrInvalidTemplate is wrapped by every error [ParseTemplate] and [NewLayout] return.
	ErrInvalidTemplate = errors.New("subjects: invalid template")
	// ErrMalformedSubject is wrapped by the errors [Layout.Parse] returns for a subject that does not
	// have the shape of a stored INCOMING subject.
	ErrMalformedSubject = errors.New("subjects: malformed subject")
	// ErrInvalidToken is wrapped by the errors [ValidToken] and [Template.Render] return for a value
	// that cannot be used as one subject token.
	ErrInvalidToken = errors.New("subjects: invalid token")
	// ErrInvalidLayout is wrapped by the error [ParseStreamLayout] returns for an unknown layout.
	ErrInvalidLayout = errors.New("subjects: invalid stream layout")
)
