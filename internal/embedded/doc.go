// Package embedded starts the NATS server kvmapper can run inside its own process: the one of
// `kvmapper run --embedded`, and the one `kvmapper bench` starts as a child process
// (`kvmapper server`). It is a production server, with JetStream on disk and the account subject
// mappings a deployment needs (setup.Config.ServerMappings) given before it accepts a
// connection; package natstest starts the servers of the tests instead. Dialling the server is
// left to internal/natsconn, and what the server holds to package setup.
package embedded
