package cli

import (
	"bytes"
	"io"
	"slices"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"
)

// Every flag of every command is in one of the groups --help shows (connection, layout and
// names, behaviour, limits), and --help shows each group under its name; every usage is one
// short line (the long explanations are in docs/).
func TestHelpGroupsEveryFlag(t *testing.T) {
	groups := []string{catConnection, catNames, catBehaviour, catLimits}
	app := newApp(io.Discard, io.Discard, Build{})
	for _, c := range app.Commands {
		if c.Hidden {
			continue
		}
		used := map[string]bool{}
		for _, f := range c.Flags {
			name := f.Names()[0]
			cat := f.(cli.CategorizableFlag).GetCategory()
			if !slices.Contains(groups, cat) {
				t.Errorf("kvmapper %s --%s is in group %q, want one of %q", c.Name, name, cat, groups)
			}
			used[cat] = true
			if u := f.(cli.DocGenerationFlag).GetUsage(); strings.Contains(u, "\n") || len(u) > 120 {
				t.Errorf("kvmapper %s --%s: usage of %d bytes, want one line of at most 120: %q", c.Name, name, len(u), u)
			}
		}
		var out bytes.Buffer
		if err := newApp(&out, io.Discard, Build{}).Run([]string{"kvmapper", c.Name, "--help"}); err != nil {
			t.Fatalf("kvmapper %s --help: %v", c.Name, err)
		}
		for g := range used {
			if !strings.Contains(out.String(), "\n   "+g+"\n") {
				t.Errorf("kvmapper %s --help shows no group %q:\n%s", c.Name, g, out.String())
			}
		}
	}
}
