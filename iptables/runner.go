// Package iptables runs iptables, ip6tables, their -save and -restore tools, on either the nf_tables
// or the legacy backend. It knows nothing about services: callers say which chains and rules they
// want, this package runs the commands and reports their failures with the tools' own words.
//
// A Runner serves one IP family on one backend. Pick the backend the host already uses with
// DetectMode (kube-proxy's rule: whichever backend holds Kubernetes' rules, else the one holding
// more rules, else what `iptables --version` says), then:
//
//	r, err := iptables.New(iptables.Options{Family: iptables.IPv4, Mode: mode})
//	err = r.EnsureChain("nat", "MY-CHAIN")
//	added, err := r.EnsureRule(iptables.Prepend, "nat", "PREROUTING", "-j", "MY-CHAIN")
//	err = r.Restore("nat", []byte(":MY-CHAIN - [0:0]\n-A MY-CHAIN -j RETURN\n"))
//
// Single rules and chains go through github.com/coreos/go-iptables; bulk changes go through
// Restore, which is one `iptables-restore --noflush` exec per table.
//
// Commands run in the network namespace of the thread that calls a method (a child process
// inherits its parent thread's namespace), so tests run a Runner inside a namespace by calling it
// from a goroutine locked to a thread that has joined the namespace (see package netnstest).
//
// A Runner is safe for concurrent use; iptables itself serialises concurrent writers (the xtables
// lock for legacy, nf_tables transactions for nft).
package iptables

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Family is the IP family a Runner serves.
type Family int

// IP families.
const (
	IPv4 Family = iota // iptables
	IPv6               // ip6tables
)

// String returns "IPv4" or "IPv6".
func (f Family) String() string {
	if f == IPv6 {
		return "IPv6"
	}
	return "IPv4"
}

// Mode is the iptables backend: which kernel subsystem the rules live in.
type Mode string

// Backends.
const (
	ModeNFT    Mode = "nft"    // iptables-nft: rules in nf_tables through the xtables compatibility layer
	ModeLegacy Mode = "legacy" // iptables-legacy: the x_tables kernel tables
)

// Position says where EnsureRule puts a rule that is missing.
type Position int

// Rule positions.
const (
	// Append adds a missing rule at the end of the chain.
	Append Position = iota
	// Prepend inserts a missing rule as the first rule of the chain.
	Prepend
)

// Options configures a Runner.
type Options struct {
	// Family selects iptables (IPv4, the zero value) or ip6tables (IPv6).
	Family Family
	// Mode selects the backend. Empty means DetectMode().
	Mode Mode
	// LockWait is how long a command waits for the xtables lock (legacy backend) before failing.
	// Zero means 5 seconds.
	LockWait time.Duration
}

// ruleTool runs the iptables command for single rules and chains.
type ruleTool interface {
	ChainExists(table, chain string) (bool, error)
	NewChain(table, chain string) error
	List(table, chain string) ([]string, error)
	Exists(table, chain string, rulespec ...string) (bool, error)
	Insert(table, chain string, pos int, rulespec ...string) error
	Append(table, chain string, rulespec ...string) error
	Delete(table, chain string, rulespec ...string) error
	ClearAndDeleteChain(table, chain string) error
}

// Runner runs the iptables tools of one IP family and one backend.
type Runner struct {
	family      Family
	mode        Mode
	ipt         ruleTool // single rules and chains: tool_unix.go, tool_windows.go
	path        string
	restorePath string
	savePath    string
	waitArg     string
}

// New returns a Runner for opts. It fails when the backend's binaries are missing.
func New(opts Options) (*Runner, error) {
	mode := opts.Mode
	if mode == "" {
		m, _, err := DetectMode()
		if err != nil {
			return nil, fmt.Errorf("detect iptables mode: %w", err)
		}
		mode = m
	}
	if mode != ModeNFT && mode != ModeLegacy {
		return nil, fmt.Errorf("iptables mode %q: want %q or %q", mode, ModeNFT, ModeLegacy)
	}
	wait := opts.LockWait
	if wait <= 0 {
		wait = 5 * time.Second
	}
	secs := int((wait + time.Second - 1) / time.Second)

	base := binaryName(opts.Family, mode, "")
	path, err := exec.LookPath(base)
	if err != nil {
		return nil, fmt.Errorf("find %s: %w", base, err)
	}
	ipt, err := newRuleTool(opts.Family, path, secs)
	if err != nil {
		return nil, fmt.Errorf("set up %s: %w", base, err)
	}
	r := &Runner{family: opts.Family, mode: mode, ipt: ipt, path: path, waitArg: "--wait=" + strconv.Itoa(secs)}
	for _, tool := range []struct {
		suffix string
		dst    *string
	}{{"-restore", &r.restorePath}, {"-save", &r.savePath}} {
		name := binaryName(opts.Family, mode, tool.suffix)
		p, err := exec.LookPath(name)
		if err != nil {
			return nil, fmt.Errorf("find %s: %w", name, err)
		}
		*tool.dst = p
	}
	return r, nil
}

// binaryName returns e.g. "ip6tables-legacy-restore" for (IPv6, ModeLegacy, "-restore").
func binaryName(f Family, m Mode, suffix string) string {
	base := "iptables"
	if f == IPv6 {
		base = "ip6tables"
	}
	return base + "-" + string(m) + suffix
}

// Family returns the IP family the Runner serves.
func (r *Runner) Family() Family { return r.family }

// Mode returns the backend the Runner uses.
func (r *Runner) Mode() Mode { return r.mode }

// String names the runner's command, e.g. "ip6tables-nft".
func (r *Runner) String() string { return binaryName(r.family, r.mode, "") }

// ChainExists reports whether chain exists in table.
func (r *Runner) ChainExists(table, chain string) (bool, error) {
	ok, err := r.ipt.ChainExists(table, chain)
	if err != nil {
		return false, fmt.Errorf("%s: check chain %s/%s: %w", r, table, chain, err)
	}
	return ok, nil
}

// EnsureChain creates chain in table unless it exists. It does not touch the chain's rules.
func (r *Runner) EnsureChain(table, chain string) error {
	ok, err := r.ChainExists(table, chain)
	if err != nil || ok {
		return err
	}
	if err := r.ipt.NewChain(table, chain); err != nil {
		// Someone may have created it in between; that is success.
		if ok, cerr := r.ipt.ChainExists(table, chain); cerr == nil && ok {
			return nil
		}
		return fmt.Errorf("%s: create chain %s/%s: %w", r, table, chain, err)
	}
	return nil
}

// EnsureRule makes sure the rule exists in table/chain; when it is missing it is inserted first
// (Prepend) or appended (Append) and added is true. A rule that exists anywhere in the chain is
// left where it is (as kube-proxy does), so two programs that both want to be first do not take
// turns moving their rules on every sync.
//
// It first looks for the rule in `iptables -S chain` (one cheap exec: iptables-nft then reads only
// that chain, where `-C` reads the whole table, 10 times slower with thousands of rules); only
// when that finds nothing does it ask `iptables -C`, which also recognises a rule printed in a
// different but equivalent form.
func (r *Runner) EnsureRule(pos Position, table, chain string, rulespec ...string) (added bool, err error) {
	if lines, err := r.ipt.List(table, chain); err == nil {
		for _, line := range lines {
			if args, err := SplitRule(line); err == nil && len(args) >= 2 && args[0] == "-A" && slices.Equal(args[2:], rulespec) {
				return false, nil
			}
		}
	}
	ok, err := r.ipt.Exists(table, chain, rulespec...)
	if err != nil {
		return false, fmt.Errorf("%s: check rule in %s/%s %q: %w", r, table, chain, rulespec, err)
	}
	if ok {
		return false, nil
	}
	if pos == Prepend {
		err = r.ipt.Insert(table, chain, 1, rulespec...)
	} else {
		err = r.ipt.Append(table, chain, rulespec...)
	}
	if err != nil {
		return false, fmt.Errorf("%s: add rule to %s/%s %q: %w", r, table, chain, rulespec, err)
	}
	return true, nil
}

// DeleteRule deletes every copy of the rule from table/chain. A missing rule or chain is no error.
func (r *Runner) DeleteRule(table, chain string, rulespec ...string) error {
	for {
		err := r.ipt.Delete(table, chain, rulespec...)
		if err == nil {
			continue
		}
		if isNotExist(err) || exitStatus(err) == 1 {
			return nil
		}
		return fmt.Errorf("%s: delete rule from %s/%s %q: %w", r, table, chain, rulespec, err)
	}
}

// DeleteJumps deletes every rule in table/chain whose target (-j) is one of targets, whatever its
// matches, and returns how many it deleted. It finds rules left behind by older versions of a
// program as well as current ones.
func (r *Runner) DeleteJumps(table, chain string, targets ...string) (int, error) {
	lines, err := r.ipt.List(table, chain)
	if err != nil {
		return 0, fmt.Errorf("%s: list %s/%s: %w", r, table, chain, err)
	}
	n := 0
	for _, line := range lines {
		args, err := SplitRule(line)
		if err != nil {
			return n, fmt.Errorf("%s: parse rule in %s/%s: %w", r, table, chain, err)
		}
		if len(args) < 2 || args[0] != "-A" || args[1] != chain || !slices.Contains(targets, ruleTarget(args)) {
			continue
		}
		if err := r.ipt.Delete(table, chain, args[2:]...); err != nil {
			if isNotExist(err) {
				continue // deleted by someone else in between
			}
			return n, fmt.Errorf("%s: delete rule %q: %w", r, line, err)
		}
		n++
	}
	return n, nil
}

// ruleTarget returns the argument of -j/--jump in args, or "".
func ruleTarget(args []string) string {
	for i := 0; i+1 < len(args); i++ {
		if args[i] == "-j" || args[i] == "--jump" {
			return args[i+1]
		}
	}
	return ""
}

// DeleteChain flushes and deletes table/chain. A missing chain is no error. It fails while rules
// elsewhere still jump to the chain.
func (r *Runner) DeleteChain(table, chain string) error {
	if err := r.ipt.ClearAndDeleteChain(table, chain); err != nil {
		return fmt.Errorf("%s: delete chain %s/%s: %w", r, table, chain, err)
	}
	return nil
}

// List returns the rules of table/chain in `iptables -S` form.
func (r *Runner) List(table, chain string) ([]string, error) {
	lines, err := r.ipt.List(table, chain)
	if err != nil {
		return nil, fmt.Errorf("%s: list %s/%s: %w", r, table, chain, err)
	}
	return lines, nil
}

// References returns how many rules jump to table/chain: the count in the header that
// `iptables -L chain` prints. It is cheap for an empty chain with iptables-nft (that reads the
// table's chains and the one chain's rules); iptables-legacy reads the whole table.
func (r *Runner) References(table, chain string) (int, error) {
	cmd := exec.Command(r.path, r.waitArg, "-t", table, "-n", "-L", chain)
	var stdout, stderr bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return 0, fmt.Errorf("%s: list %s/%s: %w: %s", r, table, chain, err, strings.TrimSpace(stderr.String()))
	}
	header, _, _ := strings.Cut(stdout.String(), "\n")
	n, ok := parseReferences(header, chain)
	if !ok {
		return 0, fmt.Errorf("%s: list %s/%s: unexpected header %q", r, table, chain, header)
	}
	return n, nil
}

// parseReferences reads the count from a chain header such as
// "Chain KUBE-X (2 references)"; a built-in chain's header ("Chain INPUT (policy ACCEPT)") has
// none.
func parseReferences(header, chain string) (int, bool) {
	rest, ok := strings.CutPrefix(header, "Chain "+chain+" (")
	if !ok {
		return 0, false
	}
	num, ok := strings.CutSuffix(rest, " references)")
	if !ok {
		num, ok = strings.CutSuffix(rest, " reference)")
	}
	if !ok {
		return 0, false
	}
	n, err := strconv.Atoi(num)
	if err != nil || n < 0 {
		return 0, false
	}
	return n, true
}

// Restore applies payload to table with one `iptables-restore --noflush` exec. payload holds the
// lines between "*table" and "COMMIT" (Restore adds both): chain lines (":CHAIN - [0:0]", which
// create the chain or flush it if it exists) and rule lines ("-A CHAIN ..."). Chains and rules the
// payload does not name are left untouched. The whole payload is applied atomically or not at all.
func (r *Runner) Restore(table string, payload []byte) error {
	header := "*" + table + "\n"
	footer := "COMMIT\n"
	if len(payload) > 0 && payload[len(payload)-1] != '\n' {
		footer = "\nCOMMIT\n"
	}
	cmd := exec.Command(r.restorePath, "--noflush", r.waitArg)
	cmd.Stdin = io.MultiReader(strings.NewReader(header), bytes.NewReader(payload), strings.NewReader(footer))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	cmd.Stdout = &stderr
	if err := cmd.Run(); err != nil {
		e := &CommandError{Command: binaryName(r.family, r.mode, "-restore"), Table: table, Stderr: strings.TrimSpace(stderr.String()), Err: err}
		if n := failedLine(e.Stderr); n > 0 {
			e.Line = n
			e.LineText = lineOf(n, header, payload, footer)
		}
		return e
	}
	return nil
}

// TablePayload is one table's input for RestoreTables: the lines between "*table" and "COMMIT".
type TablePayload struct {
	Table   string
	Payload []byte
}

// RestoreTables applies the payloads of several tables, in order, with one `iptables-restore
// --noflush` exec: what Restore does once per table, without a process start and a read of the
// kernel's state per table. Each table is committed on its own, as with one Restore each: when
// one fails, those before it are written. The error names the failing table when
// iptables-restore says which line it refused.
func (r *Runner) RestoreTables(tables ...TablePayload) error {
	var in bytes.Buffer
	type span struct {
		table       string
		first, last int // the input lines of the table, "*table" to "COMMIT"
	}
	var spans []span
	line := 1
	for _, t := range tables {
		sp := span{table: t.Table, first: line}
		in.WriteString("*" + t.Table + "\n")
		in.Write(t.Payload)
		if len(t.Payload) > 0 && t.Payload[len(t.Payload)-1] != '\n' {
			in.WriteByte('\n')
		}
		in.WriteString("COMMIT\n")
		line += 2 + bytes.Count(t.Payload, []byte("\n"))
		if len(t.Payload) > 0 && t.Payload[len(t.Payload)-1] != '\n' {
			line++
		}
		sp.last = line - 1
		spans = append(spans, sp)
	}
	input := in.Bytes()
	cmd := exec.Command(r.restorePath, "--noflush", r.waitArg)
	cmd.Stdin = bytes.NewReader(input)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	cmd.Stdout = &stderr
	if err := cmd.Run(); err != nil {
		e := &CommandError{Command: binaryName(r.family, r.mode, "-restore"), Stderr: strings.TrimSpace(stderr.String()), Err: err}
		names := make([]string, len(spans))
		for i, sp := range spans {
			names[i] = sp.table
		}
		e.Table = strings.Join(names, "+")
		if n := failedLine(e.Stderr); n > 0 {
			e.Line = n
			if lines := bytes.Split(input, []byte("\n")); n <= len(lines) {
				e.LineText = string(lines[n-1])
			}
			for _, sp := range spans {
				if n >= sp.first && n <= sp.last {
					e.Table = sp.table
				}
			}
		}
		return e
	}
	return nil
}

// Save returns `iptables-save -t table`.
func (r *Runner) Save(table string) ([]byte, error) {
	cmd := exec.Command(r.savePath, "-t", table)
	var stdout, stderr bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return nil, &CommandError{Command: binaryName(r.family, r.mode, "-save"), Table: table, Stderr: strings.TrimSpace(stderr.String()), Err: err}
	}
	return stdout.Bytes(), nil
}

// CommandError is a failed iptables-restore or iptables-save run.
type CommandError struct {
	Command  string // e.g. "iptables-nft-restore"
	Table    string
	Stderr   string // what the command printed, trimmed
	Line     int    // for restore: the input line the command complained about (1 = "*table"), or 0
	LineText string // the text of that line
	Err      error  // the exec error
}

// Error describes the failure with the command's own message.
func (e *CommandError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s (table %s): %v", e.Command, e.Table, e.Err)
	if e.Stderr != "" {
		b.WriteString(": ")
		b.WriteString(e.Stderr)
	}
	if e.Line > 0 {
		fmt.Fprintf(&b, " [input line %d: %q]", e.Line, e.LineText)
	}
	return b.String()
}

// Unwrap returns the exec error.
func (e *CommandError) Unwrap() error { return e.Err }

// failedLine finds the input line number in iptables-restore's complaint ("line 3 failed",
// "Error occurred at line: 3"), or returns 0.
func failedLine(stderr string) int {
	for _, marker := range []string{"Error occurred at line: ", "line "} {
		i := strings.Index(stderr, marker)
		for i >= 0 {
			rest := stderr[i+len(marker):]
			j := 0
			for j < len(rest) && rest[j] >= '0' && rest[j] <= '9' {
				j++
			}
			if j > 0 {
				n, err := strconv.Atoi(rest[:j])
				if err == nil {
					return n
				}
			}
			k := strings.Index(rest, marker)
			if k < 0 {
				break
			}
			i += len(marker) + k
		}
	}
	return 0
}

// lineOf returns line n (1-based) of header+payload+footer without joining them.
func lineOf(n int, header string, payload []byte, footer string) string {
	if n == 1 {
		return strings.TrimSuffix(header, "\n")
	}
	sc := bufio.NewScanner(bytes.NewReader(payload))
	sc.Buffer(make([]byte, 0, 64*1024), 1<<20)
	i := 1
	for sc.Scan() {
		i++
		if i == n {
			return sc.Text()
		}
	}
	return strings.TrimSpace(footer)
}
