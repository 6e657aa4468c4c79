package subjects

// Mapping is what a mapper learns of one device from its groups table: the values its templates
// render the device's messages with, or why it cannot map them.
type Mapping struct {
	// Values are the fields of the device's value the templates use, decoded by the layout's
	// [Schema]; empty when Reason is set.
	Values Values
	// Revision is the KV revision of the device's value; 0 when it has none.
	Revision uint64
	// Reason is empty when the device can be mapped, else the dead-letter reason (no mapping, a
	// value the templates cannot use).
	Reason string
	// Field is the field of the value at fault, when one is.
	Field string
	// Detail says what is wrong with the value, for people; "" for a device without a value.
	Detail string
}
