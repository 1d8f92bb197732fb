// Package layout checks the shape of the repository. The import graph (read with `go list`):
// which package may import which, so that data keeps flowing one way (sources → model → proxier
// → balancer, portals) as docs/architecture.md draws it. The tracked files (read with
// `git ls-files`): no reference to development history by number, no citation of a benchmark
// README heading that does not exist, no relative Markdown link to a file or heading that does
// not exist.
package layout

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"os/exec"
	"slices"
	"strings"
	"testing"
)

const module = "github.com/kube-userspace-proxy/kube-userspace-proxy"

// pkg is what `go list -json` says of one package.
type pkg struct {
	ImportPath   string
	Imports      []string
	TestImports  []string
	XTestImports []string
	Deps         []string
}

func (p pkg) rel() string { return strings.TrimPrefix(strings.TrimPrefix(p.ImportPath, module), "/") }

// local returns the module's packages in list, relative to the module ("" is the root).
func local(list []string) []string {
	var out []string
	for _, i := range list {
		if i == module || strings.HasPrefix(i, module+"/") {
			out = append(out, strings.TrimPrefix(strings.TrimPrefix(i, module), "/"))
		}
	}
	return out
}

func listPackages(t *testing.T) []pkg {
	t.Helper()
	cmd := exec.Command("go", "list", "-json", module+"/...")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v: %s", err, stderr.String())
	}
	var pkgs []pkg
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p pkg
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("decoding go list output: %v", err)
		}
		pkgs = append(pkgs, p)
	}
	if len(pkgs) < 10 {
		t.Fatalf("go list found only %d packages", len(pkgs))
	}
	return pkgs
}

func TestLayout(t *testing.T) {
	pkgs := listPackages(t)
	byPath := map[string]pkg{}
	for _, p := range pkgs {
		byPath[p.rel()] = p
	}
	for _, want := range []string{"proxy", "proxy/userspace", "loadbalancer", "portal", "cmd/kube-userspace-proxy/app"} {
		if _, ok := byPath[want]; !ok {
			t.Fatalf("package %s not found: the checks below would pass vacuously", want)
		}
	}

	t.Run("only cmd/ imports the proxier", func(t *testing.T) {
		for _, p := range pkgs {
			if strings.HasPrefix(p.rel(), "cmd/") || p.rel() == "proxy/userspace" {
				continue
			}
			all := slices.Concat(p.Imports, p.TestImports, p.XTestImports)
			if slices.Contains(local(all), "proxy/userspace") {
				t.Errorf("%s imports proxy/userspace; only cmd/ may", p.rel())
			}
		}
	})

	t.Run("loadbalancer imports only the model", func(t *testing.T) {
		lb := byPath["loadbalancer"]
		if got := local(lb.Imports); !slices.Equal(got, []string{"proxy"}) {
			t.Errorf("loadbalancer imports %v of this module; want only [proxy]", got)
		}
		// The model itself must not pull the rest of the module in behind the balancer's back.
		for _, d := range local(lb.Deps) {
			if d != "proxy" && d != "proxy/source" {
				t.Errorf("loadbalancer depends on %s (through the model); want only proxy and proxy/source", d)
			}
		}
	})

	t.Run("the model sits below everything", func(t *testing.T) {
		for _, d := range local(byPath["proxy"].Imports) {
			if d != "proxy/source" {
				t.Errorf("the model (package proxy) imports %s; it may import only proxy/source", d)
			}
		}
		for _, name := range []string{"proxy/healthcheck", "proxy/metrics", "portal"} {
			for _, d := range local(byPath[name].Imports) {
				if d == "proxy/userspace" || strings.HasPrefix(d, "cmd/") {
					t.Errorf("%s imports %s", name, d)
				}
			}
		}
	})

	t.Run("cmd/ builds no rules", func(t *testing.T) {
		for _, p := range pkgs {
			if !strings.HasPrefix(p.rel(), "cmd/") {
				continue
			}
			for _, d := range local(p.Imports) {
				if d == "iptables" || strings.HasPrefix(d, "portal/") {
					t.Errorf("%s imports %s: rules are portal's business; cmd/ only wires portal.Set", p.rel(), d)
				}
			}
		}
	})
}
