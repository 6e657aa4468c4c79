package audit

// OrderedConsumer is orderedConsumer, for tests.
var OrderedConsumer = orderedConsumer
