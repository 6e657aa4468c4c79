package ordered

// SetBeforePublish makes f run at the start of every publish until the returned func is called.
func SetBeforePublish(f func()) (restore func()) {
	beforePublish = f
	return func() { beforePublish = nil }
}
