package integration

import (
	"bytes"
	"errors"
	"os/exec"
	"strings"
	"testing"
)

// runCLI runs kvmapper with args and returns its stdout, stderr and exit code.
func runCLI(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("running kvmapper %v: %v", args, err)
	}
	checkRaces(t, strings.Join(args, " "), errb.String())
	return out.String(), errb.String(), code
}

func TestHelp(t *testing.T) {
	for _, args := range [][]string{
		{"--help"},
		{"run", "--help"},
		{"setup", "--help"},
		{"verify", "--help"},
	} {
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			out, errOut, code := runCLI(t, args...)
			if code != 0 {
				t.Fatalf("exit code %d, want 0; stderr: %s", code, errOut)
			}
			for _, want := range []string{"USAGE", "kvmapper"} {
				if !strings.Contains(out, want) {
					t.Errorf("help output lacks %q:\n%s", want, out)
				}
			}
		})
	}
	out, _, _ := runCLI(t, "run", "--help")
	for _, flag := range []string{"--server", "--embedded", "--listen", "--data-dir", "--partitions", "--in", "--out", "--unmapped",
		"--replica-id", "--log-level", "--log-format", "--lease-ttl", "KVMAPPER_PARTITIONS", "NATS_URL"} {
		if !strings.Contains(out, flag) {
			t.Errorf("kvmapper run --help does not mention %s", flag)
		}
	}
}

func TestBadFlagValueIsOneLineAndExitCode2(t *testing.T) {
	for name, args := range map[string][]string{
		"not a number":                    {"run", "--partitions", "abc"},
		"unknown flag":                    {"run", "--no-such-flag"},
		"bad log format":                  {"run", "--log-format", "xml"},
		"bad log level":                   {"setup", "--log-level", "loud"},
		"bad template":                    {"run", "--out", "outgoing.{group}.{event}"},
		"bad header":                      {"run", "--header", "Tenant={tenant"},
		"reserved header":                 {"run", "--header", "Nats-Msg-Id={tenant}"},
		"zero partitions":                 {"setup", "--partitions", "0"},
		"lease ttl fraction":              {"run", "--lease-ttl", "1500ms"},
		"bad listen":                      {"run", "--embedded", "--listen", "nowhere"},
		"unknown command":                 {"frobnicate"},
		"replica id with dot":             {"run", "--replica-id", "a.b"},
		"in flight below one a partition": {"run", "--max-in-flight", "8"},
		"in flight bytes too few":         {"run", "--max-in-flight-bytes", "1000"},
		"unknown stream layout":           {"verify", "--layout", "sharded"},
	} {
		t.Run(name, func(t *testing.T) {
			out, errOut, code := runCLI(t, args...)
			if code != 2 {
				t.Fatalf("exit code %d, want 2; stdout %q stderr %q", code, out, errOut)
			}
			lines := strings.Split(strings.TrimSpace(errOut), "\n")
			if len(lines) != 1 || !strings.HasPrefix(lines[0], "kvmapper: ") {
				t.Errorf("stderr = %q, want one line starting with \"kvmapper: \"", errOut)
			}
			if out != "" {
				t.Errorf("stdout = %q, want nothing (no usage dump)", out)
			}
		})
	}
}

func TestEnvironmentVariablesAreRead(t *testing.T) {
	cmd := exec.Command(bin, "setup")
	cmd.Env = append(cmd.Environ(), "KVMAPPER_PARTITIONS=nope")
	var errb bytes.Buffer
	cmd.Stderr = &errb
	err := cmd.Run()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 2 || !strings.Contains(errb.String(), "partitions") {
		t.Errorf("KVMAPPER_PARTITIONS=nope: err %v, stderr %q; want exit 2 naming the flag", err, errb.String())
	}
}
