//go:build linux

package iptables

import (
	"errors"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables/netnstest"
)

// requireBackends fails the test when the tools of both backends are not installed.
func requireBackends(t *testing.T) {
	t.Helper()
	var names []string
	for _, f := range []Family{IPv4, IPv6} {
		for _, m := range []Mode{ModeNFT, ModeLegacy} {
			for _, s := range []string{"", "-save", "-restore"} {
				names = append(names, binaryName(f, m, s))
			}
		}
	}
	netnstest.RequireTools(t, "Debian package iptables ships both the -nft and the -legacy tools", names...)
}

type backend struct {
	family Family
	mode   Mode
}

func (b backend) String() string { return binaryName(b.family, b.mode, "") }

var allBackends = []backend{{IPv4, ModeNFT}, {IPv4, ModeLegacy}, {IPv6, ModeNFT}, {IPv6, ModeLegacy}}

// run runs the backend's iptables with args (in the calling thread's namespace).
func (b backend) run(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command(binaryName(b.family, b.mode, ""), args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v: %s", b, strings.Join(args, " "), err, out)
	}
	return string(out)
}

func TestRunnerInNamespace(t *testing.T) {
	requireBackends(t)
	for _, b := range allBackends {
		t.Run(b.String(), func(t *testing.T) {
			ns := netnstest.New(t)
			ns.Do(t, func() {
				testRunner(t, b)
			})
		})
	}
}

func testRunner(t *testing.T, b backend) {
	r, err := New(Options{Family: b.family, Mode: b.mode})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	if r.Family() != b.family || r.Mode() != b.mode {
		t.Fatalf("runner is %v/%v, want %v/%v", r.Family(), r.Mode(), b.family, b.mode)
	}

	// Chains: create, idempotent.
	for i := 0; i < 2; i++ {
		if err := r.EnsureChain("nat", "KUBE-TEST"); err != nil {
			t.Fatalf("EnsureChain #%d: %v", i, err)
		}
	}
	if ok, err := r.ChainExists("nat", "KUBE-TEST"); err != nil || !ok {
		t.Fatalf("ChainExists after EnsureChain = %v, %v", ok, err)
	}
	if ok, err := r.ChainExists("nat", "KUBE-NOPE"); err != nil || ok {
		t.Fatalf("ChainExists(missing) = %v, %v", ok, err)
	}

	// Rules: prepend and append, idempotent, existing rules left in place.
	first := []string{"-m", "comment", "--comment", "first jump; with spaces", "-j", "KUBE-TEST"}
	last := []string{"-p", "tcp", "-m", "addrtype", "--dst-type", "LOCAL", "-j", "KUBE-TEST"}
	b.run(t, "-t", "nat", "-A", "PREROUTING", "-p", "udp", "-j", "ACCEPT")
	ensure := func(pos Position, spec []string, wantAdded bool) {
		t.Helper()
		added, err := r.EnsureRule(pos, "nat", "PREROUTING", spec...)
		if err != nil {
			t.Fatalf("EnsureRule(%q): %v", spec, err)
		}
		if added != wantAdded {
			t.Fatalf("EnsureRule(%q) added = %v, want %v", spec, added, wantAdded)
		}
	}
	ensure(Prepend, first, true)
	ensure(Append, last, true)
	ensure(Prepend, first, false)
	ensure(Append, last, false)
	rules, err := r.List("nat", "PREROUTING")
	if err != nil {
		t.Fatal(err)
	}
	rules = onlyRules(rules)
	if len(rules) != 3 || !strings.Contains(rules[0], `"first jump; with spaces"`) || !strings.Contains(rules[2], "LOCAL") {
		t.Fatalf("PREROUTING = %q, want [first jump, foreign udp, addrtype jump]", rules)
	}
	// References counts the jumps to a chain; a missing chain is an error.
	if n, err := r.References("nat", "KUBE-TEST"); err != nil || n != 2 {
		t.Errorf("References(KUBE-TEST) = %d, %v; want 2 (the two jumps in PREROUTING)", n, err)
	}
	if n, err := r.References("nat", "KUBE-NOPE"); err == nil {
		t.Errorf("References(missing chain) = %d, nil; want an error", n)
	}

	// Restore: creates and flushes only the chains it names.
	b.run(t, "-t", "nat", "-N", "FOREIGN")
	b.run(t, "-t", "nat", "-A", "FOREIGN", "-p", "tcp", "-j", "RETURN")
	if err := r.Restore("nat", []byte(":KUBE-TEST - [0:0]\n:KUBE-OTHER - [0:0]\n-A KUBE-TEST -p tcp -m tcp --dport 80 -j RETURN\n-A KUBE-OTHER -p tcp -m tcp --dport 81 -j RETURN\n")); err != nil {
		t.Fatalf("Restore #1: %v", err)
	}
	save := mustSave(t, r, "nat")
	for _, want := range []string{"-A KUBE-TEST -p tcp -m tcp --dport 80 -j RETURN", "-A KUBE-OTHER -p tcp -m tcp --dport 81 -j RETURN", "-A FOREIGN -p tcp -j RETURN"} {
		if !strings.Contains(save, want) {
			t.Errorf("after Restore #1, save lacks %q:\n%s", want, save)
		}
	}
	if err := r.Restore("nat", []byte(":KUBE-TEST - [0:0]\n-A KUBE-TEST -p udp -m udp --dport 53 -j RETURN")); err != nil {
		t.Fatalf("Restore #2: %v", err)
	}
	save = mustSave(t, r, "nat")
	if strings.Contains(save, "--dport 80") {
		t.Errorf("after Restore #2 the flushed rule is still there:\n%s", save)
	}
	for _, want := range []string{"-A KUBE-TEST -p udp -m udp --dport 53 -j RETURN", "-A KUBE-OTHER -p tcp -m tcp --dport 81 -j RETURN", "-A FOREIGN -p tcp -j RETURN", `"first jump; with spaces"`} {
		if !strings.Contains(save, want) {
			t.Errorf("after Restore #2, save lacks %q:\n%s", want, save)
		}
	}

	// Restore errors name the tool, its message and the offending line; nothing is applied.
	err = r.Restore("nat", []byte(":KUBE-TEST - [0:0]\n-A KUBE-TEST -p tcp -m tcp --dport 99 -j RETURN\n-A KUBE-TEST -p tcp --bogus-option -j RETURN\n"))
	var ce *CommandError
	if !errors.As(err, &ce) {
		t.Fatalf("Restore(bad) error = %v, want *CommandError", err)
	}
	if ce.Line != 4 || !strings.Contains(ce.LineText, "--bogus-option") || !strings.Contains(ce.Stderr, "bogus-option") {
		t.Errorf("Restore(bad) error = %+v, want line 4 with --bogus-option", ce)
	}
	if save := mustSave(t, r, "nat"); strings.Contains(save, "--dport 99") || !strings.Contains(save, "--dport 53") {
		t.Errorf("failed Restore changed the table:\n%s", save)
	}

	// RestoreTables: both tables in one exec, each as Restore would; an error names the table
	// and line it refused (the tables before it are written).
	if err := r.RestoreTables(TablePayload{"filter", []byte(":KUBE-FT - [0:0]\n-A KUBE-FT -p tcp -m tcp --dport 7 -j RETURN\n")},
		TablePayload{"nat", []byte("-A KUBE-TEST -p tcp -m tcp --dport 77 -j RETURN")}); err != nil {
		t.Fatalf("RestoreTables: %v", err)
	}
	if save := mustSave(t, r, "filter"); !strings.Contains(save, "-A KUBE-FT -p tcp -m tcp --dport 7 -j RETURN") {
		t.Errorf("after RestoreTables, filter lacks its rule:\n%s", save)
	}
	if save := mustSave(t, r, "nat"); !strings.Contains(save, "--dport 77") || !strings.Contains(save, "--dport 53") {
		t.Errorf("after RestoreTables, nat lacks the appended rule or lost the one there:\n%s", save)
	}
	err = r.RestoreTables(TablePayload{"filter", []byte("-A KUBE-FT -p tcp -m tcp --dport 8 -j RETURN\n")},
		TablePayload{"nat", []byte("-A KUBE-TEST -p tcp -m tcp --dport 78 -j RETURN\n-A KUBE-TEST -p tcp --bogus-option -j RETURN\n")})
	if !errors.As(err, &ce) {
		t.Fatalf("RestoreTables(bad) error = %v, want *CommandError", err)
	}
	if ce.Table != "nat" || ce.Line != 6 || !strings.Contains(ce.LineText, "--bogus-option") {
		t.Errorf("RestoreTables(bad) error = %+v, want table nat, line 6 with --bogus-option", ce)
	}
	if save := mustSave(t, r, "nat"); strings.Contains(save, "--dport 78") {
		t.Errorf("failed RestoreTables changed the nat table:\n%s", save)
	}
	b.run(t, "-t", "filter", "-F", "KUBE-FT")
	b.run(t, "-t", "filter", "-X", "KUBE-FT")

	// DeleteJumps removes every jump to the chain, whatever its matches, and nothing else.
	n, err := r.DeleteJumps("nat", "PREROUTING", "KUBE-TEST")
	if err != nil || n != 2 {
		t.Fatalf("DeleteJumps = %d, %v; want 2, nil", n, err)
	}
	rules, err = r.List("nat", "PREROUTING")
	if err != nil {
		t.Fatal(err)
	}
	if rules = onlyRules(rules); len(rules) != 1 || !strings.Contains(rules[0], "udp") {
		t.Errorf("PREROUTING after DeleteJumps = %q, want only the foreign rule", rules)
	}
	if n, err := r.DeleteJumps("nat", "PREROUTING", "KUBE-TEST"); err != nil || n != 0 {
		t.Errorf("DeleteJumps again = %d, %v; want 0, nil", n, err)
	}

	// DeleteRule: all copies, missing is fine.
	ensure(Append, last, true)
	b.run(t, append([]string{"-t", "nat", "-A", "PREROUTING"}, last...)...)
	for i := 0; i < 2; i++ {
		if err := r.DeleteRule("nat", "PREROUTING", last...); err != nil {
			t.Fatalf("DeleteRule #%d: %v", i, err)
		}
	}
	if err := r.DeleteRule("nat", "KUBE-NOPE", "-j", "RETURN"); err != nil {
		t.Errorf("DeleteRule in missing chain: %v", err)
	}
	if rules, _ := r.List("nat", "PREROUTING"); len(onlyRules(rules)) != 1 {
		t.Errorf("PREROUTING after DeleteRule = %q", rules)
	}

	// DeleteChain: flush + delete; missing is fine.
	for i := 0; i < 2; i++ {
		for _, c := range []string{"KUBE-TEST", "KUBE-OTHER"} {
			if err := r.DeleteChain("nat", c); err != nil {
				t.Fatalf("DeleteChain(%s) #%d: %v", c, i, err)
			}
		}
	}
	if save := mustSave(t, r, "nat"); strings.Contains(save, "KUBE-") || !strings.Contains(save, ":FOREIGN") {
		t.Errorf("after DeleteChain:\n%s", save)
	}
}

func onlyRules(lines []string) []string {
	return slices.DeleteFunc(slices.Clone(lines), func(l string) bool { return !strings.HasPrefix(l, "-A ") })
}

func mustSave(t *testing.T, r *Runner, table string) string {
	t.Helper()
	out, err := r.Save(table)
	if err != nil {
		t.Fatalf("Save(%s): %v", table, err)
	}
	return string(out)
}

// TestDetectModeInNamespace runs the real tools: rules in one backend make DetectMode pick it.
func TestDetectModeInNamespace(t *testing.T) {
	requireBackends(t)
	ver, err := exec.Command("iptables", "--version").Output()
	if err != nil {
		t.Fatalf("iptables --version: %v", err)
	}
	defaultMode := modeFromVersion(string(ver))
	tests := []struct {
		name  string
		setup []backend // add one KUBE- chain with a rule in each
		want  Mode
	}{
		{name: "empty namespace", want: defaultMode},
		{name: "legacy KUBE rules", setup: []backend{{IPv4, ModeLegacy}}, want: ModeLegacy},
		{name: "legacy IPv6 KUBE rules", setup: []backend{{IPv6, ModeLegacy}}, want: ModeLegacy},
		{name: "nft KUBE rules", setup: []backend{{IPv4, ModeNFT}}, want: ModeNFT},
		{name: "nft beats legacy by count", setup: []backend{{IPv4, ModeNFT}, {IPv6, ModeNFT}, {IPv4, ModeLegacy}}, want: ModeNFT},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ns := netnstest.New(t)
			ns.Do(t, func() {
				for _, b := range tc.setup {
					b.run(t, "-t", "nat", "-N", "KUBE-DETECT")
					b.run(t, "-t", "nat", "-A", "PREROUTING", "-j", "KUBE-DETECT")
				}
				got, reason, err := DetectMode()
				if err != nil {
					t.Fatalf("DetectMode: %v", err)
				}
				if got != tc.want {
					t.Errorf("DetectMode = %q (%s), want %q", got, reason, tc.want)
				}
			})
		})
	}
}

func TestParseReferences(t *testing.T) {
	for _, tc := range []struct {
		header string
		want   int
		ok     bool
	}{
		{"Chain KUBE-X (4 references)", 4, true},
		{"Chain KUBE-X (0 references)", 0, true},
		{"Chain KUBE-X (1 reference)", 1, true},
		{"Chain INPUT (policy ACCEPT)", 0, false},
		{"Chain KUBE-Y (4 references)", 0, false},
		{"Chain KUBE-X (-1 references)", 0, false},
		{"", 0, false},
	} {
		if n, ok := parseReferences(tc.header, "KUBE-X"); n != tc.want || ok != tc.ok {
			t.Errorf("parseReferences(%q) = %d, %v; want %d, %v", tc.header, n, ok, tc.want, tc.ok)
		}
	}
}
