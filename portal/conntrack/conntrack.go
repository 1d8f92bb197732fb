// Package conntrack deletes the kernel's connection-tracking entries of UDP flows whose portal
// changed, with the conntrack tool (Debian package conntrack), as kube-proxy's userspace mode
// did with `conntrack -D --orig-dst <clusterIP> -p udp`.
//
// Why: the nat table is consulted only for a flow's first packet; the conntrack entry then NATs
// every later packet of the flow the same way for as long as packets keep coming (a UDP entry
// lives 30 s after the last one). A DNS client that reuses its source port would keep being
// sent to a proxy port that no longer exists (after a restart, or a protocol change), or past
// the rules entirely (its first datagram came before the rules existed), for as long as it keeps
// asking. Deleting the entries makes the next datagram a new flow that meets the current rules.
//
// Deletions are exact, batched and bounded: every filter names the protocol (UDP), the original
// destination address and the original destination port, so no flow of another service, another
// address or another protocol goes; all of a call's filters go to one conntrack run (`conntrack
// -R -`, conntrack-tools 1.4.7 and later, reading one `-D` command per line), or, with an older
// tool, to one run per filter; and every run is killed when it exceeds Tool.Timeout. The tool
// runs in the network namespace of the calling thread.
package conntrack

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Defaults of Tool.
const (
	// DefaultTimeout bounds one conntrack run.
	DefaultTimeout = 5 * time.Second
)

// Tool runs the conntrack command-line tool. The zero value uses "conntrack" from PATH. A Tool
// must not be copied after first use; its methods may be called concurrently.
type Tool struct {
	// Path is the conntrack binary; empty means "conntrack".
	Path string
	// Timeout bounds each run of the tool (it is killed then); zero means DefaultTimeout.
	Timeout time.Duration

	mu      sync.Mutex
	noBatch bool // the tool does not know -R: one run per filter
}

var deletedRE = regexp.MustCompile(`(\d+) flow entries have been deleted`)

// DeleteUDP deletes the UDP flows whose original destination is exactly one of dsts (address and
// port; IPv4-mapped addresses count as IPv4) in as few runs of the tool as it can. A run that
// fails or times out is reported in the error; the other filters are still applied.
func (t *Tool) DeleteUDP(dsts []netip.AddrPort) error {
	if len(dsts) == 0 {
		return nil
	}
	filters := make([][]string, 0, len(dsts))
	for _, d := range dsts {
		addr := d.Addr().Unmap()
		if !addr.IsValid() || addr.IsUnspecified() || d.Port() == 0 {
			return fmt.Errorf("conntrack: delete UDP flows: %v is not an address and port", d)
		}
		family := "ipv4"
		if addr.Is6() {
			family = "ipv6"
		}
		filters = append(filters, []string{"-D", "-p", "udp", "-f", family, "--orig-dst", addr.WithZone("").String(),
			"--orig-port-dst", strconv.Itoa(int(d.Port()))})
	}
	t.mu.Lock()
	batch := !t.noBatch
	t.mu.Unlock()
	if batch {
		err := t.batch(filters)
		if !errors.Is(err, errNoBatch) {
			return err
		}
		t.mu.Lock()
		t.noBatch = true
		t.mu.Unlock()
	}
	return t.each(filters)
}

var errNoBatch = errors.New("conntrack cannot read commands from a file (-R): older than conntrack-tools 1.4.7")

// batch runs every filter in one `conntrack -R -`.
func (t *Tool) batch(filters [][]string) error {
	var in bytes.Buffer
	for _, f := range filters {
		in.WriteString(strings.Join(f, " "))
		in.WriteByte('\n')
	}
	out, err := t.run(&in, "-R", "-")
	if err == nil {
		return nil
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) && strings.Contains(out, "option") && (strings.Contains(out, "`-R'") || strings.Contains(out, "'-R'") || strings.Contains(out, "-- 'R'")) {
		return errNoBatch
	}
	return fmt.Errorf("conntrack -R - (%d filters, first %q): %w: %s", len(filters), strings.Join(filters[0], " "), err, out)
}

// each runs one `conntrack -D` per filter, one after the other. Not concurrently: a child
// process runs in the network namespace of the thread that starts it, which only the calling
// goroutine's is known to be (tests run the tool inside namespaces).
func (t *Tool) each(filters [][]string) error {
	var errs []error
	for _, f := range filters {
		out, err := t.run(nil, f...)
		// It exits with status 1 when nothing matched: that is not a failure here.
		if deletedRE.MatchString(out) {
			continue
		}
		if err == nil {
			err = errors.New("no count of deleted entries in its output")
		}
		errs = append(errs, fmt.Errorf("conntrack %s: %w: %s", strings.Join(f, " "), err, out))
	}
	return errors.Join(errs...)
}

// run runs the tool with args (and stdin, if not nil) within Timeout and returns its output,
// trimmed.
func (t *Tool) run(stdin *bytes.Buffer, args ...string) (string, error) {
	timeout := t.Timeout
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	path := t.Path
	if path == "" {
		path = "conntrack"
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, path, args...)
	if stdin != nil {
		cmd.Stdin = stdin
	}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	// A killed run's children may hold its output open: stop waiting for them soon after, and
	// kill them with it where processes have groups.
	cmd.WaitDelay = time.Second
	killGroup(cmd)
	err := cmd.Run()
	if ctx.Err() != nil {
		err = fmt.Errorf("timed out after %v: %w", timeout, errors.Join(ctx.Err(), err))
	}
	return strings.TrimSpace(out.String()), err
}
