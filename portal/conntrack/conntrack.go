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
package conntrack

import (
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
)

// Tool runs the conntrack command-line tool. The zero value uses "conntrack" from PATH.
type Tool struct {
	// Path is the conntrack binary; empty means "conntrack".
	Path string
}

var deletedRE = regexp.MustCompile(`(\d+) flow entries have been deleted`)

// DeleteUDP deletes the UDP flows whose original destination is dst (any address of dst's family
// when dst is the unspecified address) and port, and returns how many it deleted.
func (t Tool) DeleteUDP(dst netip.Addr, port int) (int, error) {
	dst = dst.Unmap()
	family := "ipv4"
	if dst.Is6() {
		family = "ipv6"
	}
	args := []string{"-D", "-p", "udp", "-f", family, "--orig-port-dst", strconv.Itoa(port)}
	if !dst.IsUnspecified() {
		args = append(args, "--orig-dst", dst.String())
	}
	path := t.Path
	if path == "" {
		path = "conntrack"
	}
	out, err := exec.Command(path, args...).CombinedOutput()
	m := deletedRE.FindSubmatch(out)
	if m == nil {
		if err == nil {
			err = errors.New("no count of deleted entries in its output")
		}
		return 0, fmt.Errorf("conntrack %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	// It exits with status 1 when nothing matched: that is not a failure here.
	n, _ := strconv.Atoi(string(m[1]))
	return n, nil
}
