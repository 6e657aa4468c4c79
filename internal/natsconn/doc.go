// Package natsconn connects kvmapper to NATS the way the nats CLI does: [Settings] say which
// servers to dial and how to authenticate (user and password, token, credentials or NKey files,
// TLS), [LoadContext] reads them from a nats CLI context, [Overrides] put explicitly given values
// over a context's, and [Dial] checks them, dials with the options a kvmapper process relies on
// (no publish buffering while reconnecting, reconnecting forever) and logs the errors the server
// sends later, naming the permission to grant for a violation. Its error messages say what to fix
// and never contain a secret; they name the kvmapper flag that maps to each field. Parsing flags
// and the environment, and deciding what to do with the connection, are left to the caller.
package natsconn
