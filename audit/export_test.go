package audit

// The audit's requests that wait out a 503, for tests.
var (
	OrderedConsumer = orderedConsumer
	StreamInfo      = streamInfo
	StreamIfAllowed = streamIfAllowed
)
