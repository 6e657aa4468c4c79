package status

import (
	"regexp"
	"strings"
	"time"
)

// ServiceName is the NATS micro service name every replica registers.
const ServiceName = "kvmapper"

// Report is what a replica answers on its status endpoint.
type Report struct {
	Replica       string    `json:"replica"`
	Host          string    `json:"host"`
	Version       string    `json:"version"`
	Started       time.Time `json:"started"`
	UptimeSeconds float64   `json:"uptime_seconds"`
	// Ready is false until the groups table is loaded, and again while the replica stops.
	Ready bool `json:"ready"`
	// Owned lists the partitions the replica holds a lease for, including ones being handed over.
	Owned []int `json:"owned"`
	// Partitions describe the lanes running now.
	Partitions []PartitionReport `json:"partitions"`
	Counters   Counters          `json:"counters"`
	Table      Table             `json:"table"`
}

// PartitionReport is one running lane's progress.
type PartitionReport struct {
	Partition  int    `json:"partition"`
	Epoch      uint64 `json:"epoch"`
	Acked      uint64 `json:"acked"`      // last INCOMING sequence of the contiguous acknowledged prefix
	Checkpoint uint64 `json:"checkpoint"` // last sequence written to checkpoint.<p>
	Pending    uint64 `json:"pending"`    // messages not yet delivered to the lane
	InFlight   int    `json:"in_flight"`  // publishes awaiting acknowledgement
	Lag        uint64 `json:"lag"`        // pending + in flight
	// ParkedDevices and ParkedMessages are what the lane holds parked, as far as it knows.
	ParkedDevices  int64 `json:"parked_devices,omitempty"`
	ParkedMessages int64 `json:"parked_messages,omitempty"`
	// Waiting is what the lane has been waiting for, for more than a few seconds; nil when it
	// has not (lanes.Wait).
	Waiting *Waiting `json:"waiting,omitempty"`
}

// Waiting is what a partition's lane waits for: "publish" (its oldest publish has no answer
// from Stream), "consumer" (its consumer on Stream delivers nothing the stream's leader
// holds), "window" (the replica's in-flight window is full) or "checkpoint" (it takes nothing
// new until its checkpoint is written), on which server when known, since when.
type Waiting struct {
	For    string    `json:"for"`
	Stream string    `json:"stream,omitempty"`
	Server string    `json:"server,omitempty"`
	Since  time.Time `json:"since"`
}

// Counters are a replica's totals since it started.
type Counters struct {
	Mapped     uint64            `json:"mapped"`
	Unmapped   map[string]uint64 `json:"unmapped"`
	Duplicates uint64            `json:"duplicates"`
	Retries    uint64            `json:"retries"`
	Failures   uint64            `json:"failures"`
	InFlight   int               `json:"in_flight"`
	// Parked counts messages parked in PARKED, Released those republished from it to OUTGOING;
	// ParkedDevices and ParkedMessages are what the replica's lanes hold parked now.
	Parked         uint64 `json:"parked,omitempty"`
	Released       uint64 `json:"released,omitempty"`
	ParkedDevices  int64  `json:"parked_devices,omitempty"`
	ParkedMessages int64  `json:"parked_messages,omitempty"`
}

// Table describes a replica's in-memory groups table.
type Table struct {
	Devices  int    `json:"devices"`
	Revision uint64 `json:"revision"`
	// Invalid counts, by reason (wire.ValueReasons), the devices whose value the templates
	// cannot use: their messages are dead-lettered with that reason, or parked.
	Invalid map[string]int `json:"invalid,omitempty"`
}

// StatusSubject is the subject of replica id's status endpoint for the control bucket control.
// The bucket is part of it so that deployments sharing an account do not answer for each other.
func StatusSubject(control, id string) string {
	return "kvmapper.status." + control + "." + id
}

// semver is the pattern micro.AddService checks versions against (nats.go micro/service.go).
var semver = regexp.MustCompile(`^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$`)

// microVersion returns v as the SemVer string micro services require: a leading "v" is
// dropped, and anything else that is not SemVer ("dev") becomes "0.0.0-" followed by it, cleaned.
func microVersion(v string) string {
	v = strings.TrimPrefix(v, "v")
	if semver.MatchString(v) {
		return v
	}
	clean := strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' {
			return r
		}
		return '-'
	}, v)
	if v = "0.0.0-" + clean; !semver.MatchString(v) {
		v = "0.0.0-unknown"
	}
	return v
}
