package audit

import (
	"strings"

	"github.com/kvmapper/kvmapper/subjects"
)

// devParser finds the {device} token of subjects of one template without allocating.
type devParser struct {
	toks []string // the template's tokens; placeholders as "{name}"
	ph   []bool
	dev  int // index of {device} among toks, or -1
}

func newDevParser(t *subjects.Template) devParser {
	toks := strings.Split(t.String(), ".")
	p := devParser{toks: toks, ph: make([]bool, len(toks)), dev: -1}
	for i, tk := range toks {
		p.ph[i] = strings.HasPrefix(tk, "{") && strings.HasSuffix(tk, "}")
		if tk == "{device}" && p.dev < 0 {
			p.dev = i
		}
	}
	return p
}

// device returns the device token of subject, or "" when subject does not have the template's
// shape.
func (p *devParser) device(subject string) string {
	var dev string
	rest := subject
	for i, tk := range p.toks {
		tok := rest
		if i < len(p.toks)-1 {
			j := strings.IndexByte(rest, '.')
			if j < 0 {
				return ""
			}
			tok, rest = rest[:j], rest[j+1:]
		} else if strings.IndexByte(rest, '.') >= 0 {
			return ""
		}
		switch {
		case tok == "":
			return ""
		case !p.ph[i]:
			if tok != tk {
				return ""
			}
		case i == p.dev:
			dev = tok
		}
	}
	return dev
}
