//go:build linux

package cluster

import "testing"

func TestCheckSynced(t *testing.T) {
	tests := []struct {
		name    string
		metrics string
		wantErr bool
	}{
		{name: "synced", metrics: "# HELP x\nkubeproxy_sync_proxy_rules_last_timestamp_seconds 1.7e+09\nother 1\n"},
		{name: "synced per family", metrics: "kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"} 1.795318910505635e+09\nkubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv6\"} 1.7953189108549676e+09\n"},
		{name: "one family not synced", metrics: "kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"} 1.795318910505635e+09\nkubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv6\"} 0\n", wantErr: true},
		{name: "never synced", metrics: "kubeproxy_sync_proxy_rules_last_timestamp_seconds 0\n", wantErr: true},
		{name: "not reported", metrics: "kubeproxy_sync_proxy_rules_duration_seconds_count 0\n", wantErr: true},
		{name: "prefix of another metric", metrics: "kubeproxy_sync_proxy_rules_last_timestamp_seconds_total 5\n", wantErr: true},
		{name: "garbage value", metrics: "kubeproxy_sync_proxy_rules_last_timestamp_seconds x\n", wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := checkSynced([]byte(tc.metrics))
			if (err != nil) != tc.wantErr {
				t.Errorf("checkSynced() = %v, want error %v", err, tc.wantErr)
			}
		})
	}
}
