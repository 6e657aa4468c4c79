package natsconn

import (
	"errors"
	"regexp"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"

	"github.com/kvmapper/kvmapper/internal/ratelog"
)

// permissionRE picks the operation and subject out of nats.go's permissions violation error.
var permissionRE = regexp.MustCompile(`(Publish|Subscription) to "([^"]+)"`)

// asyncError logs an error the server sent outside any request: at most one line per second
// for each kind (permissions, other), counting the rest as suppressed. A permissions violation
// names the permission to grant: kvmapper keeps retrying, so granting it resumes the work.
func asyncError(log zerolog.Logger, limit *ratelog.Limiter, sub *nats.Subscription, err error) {
	if errors.Is(err, nats.ErrPermissionViolation) {
		op, subject := "publish", ""
		if m := permissionRE.FindStringSubmatch(err.Error()); m != nil {
			subject = m[2]
			if m[1] == "Subscription" {
				op = "subscribe"
			}
		}
		suppressed, ok := limit.Allow("permissions")
		if !ok {
			return
		}
		grant := grantFor(subject)
		log.Error().Str("operation", op).Str("subject", subject).Str("grant", grant).Int("suppressed", suppressed).
			Msgf("NATS permissions violation: this user may not %s to %q; grant it %s on %q (see docs/security.md, Least privilege)",
				op, subject, op, grant)
		return
	}
	suppressed, ok := limit.Allow("other")
	if !ok {
		return
	}
	ev := log.Error().Err(err).Int("suppressed", suppressed)
	if sub != nil {
		ev = ev.Str("subject", sub.Subject)
	}
	ev.Msg("NATS error")
}

// grantFor returns the permission subject (as docs/security.md's least-privilege list spells it)
// that covers subject.
func grantFor(subject string) string {
	t := strings.Split(subject, ".")
	switch {
	case len(t) >= 6 && t[0] == "$JS" && t[1] == "API" && t[2] == "CONSUMER" && t[3] == "CREATE":
		return strings.Join(t[:5], ".") + ".>" // $JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>
	case len(t) >= 6 && t[0] == "$JS" && t[1] == "API" && t[2] == "CONSUMER" && t[3] == "MSG" && t[4] == "NEXT":
		return strings.Join(t[:6], ".") + ".*"
	case len(t) >= 5 && t[0] == "$JS" && t[1] == "API" && t[2] == "CONSUMER":
		return strings.Join(t[:5], ".") + ".*"
	case len(t) >= 5 && t[0] == "$JS" && t[1] == "API" && t[2] == "DIRECT" && t[3] == "GET":
		return strings.Join(t[:5], ".") + ".>"
	case len(t) >= 2 && t[0] == "$JS" && t[1] == "API":
		return subject
	case len(t) >= 3 && t[0] == "$JS" && t[1] == "FC":
		return "$JS.FC." + t[2] + ".>"
	case len(t) >= 2 && t[0] == "$KV":
		return "$KV." + t[1] + ".>"
	case t[0] == "$SRV":
		return "$SRV.>"
	case len(t) >= 3 && t[0] == "kvmapper" && t[1] == "status":
		return strings.Join(t[:len(t)-1], ".") + ".*" // every replica's status endpoint
	case t[0] == "kvmapper" || t[0] == "$JS":
		return subject
	}
	return t[0] + ".>" // the outputs (outgoing.>, unmapped.>) and inboxes (_INBOX.>)
}
