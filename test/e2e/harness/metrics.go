//go:build linux

package harness

import (
	"bufio"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// ScrapeMetrics returns the Prometheus metrics served on addr inside ns, each sample by its name
// with its labels as exposed (`name{a="x",b="y"}`, labels sorted by name).
func ScrapeMetrics(ns *netns.NS, addr string) (map[string]float64, error) {
	hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DialContext: ns.DialContext, DisableKeepAlives: true}}
	resp, err := hc.Get("http://" + addr + "/metrics")
	if err != nil {
		return nil, fmt.Errorf("scrape metrics: %w", err)
	}
	defer resp.Body.Close()
	vals := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		i := strings.LastIndexByte(line, ' ')
		if strings.HasPrefix(line, "#") || i < 0 {
			continue
		}
		v, _ := strconv.ParseFloat(line[i+1:], 64)
		vals[line[:i]] = v
	}
	return vals, sc.Err()
}
