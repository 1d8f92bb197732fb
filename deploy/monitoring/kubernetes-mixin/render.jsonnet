// The kube-proxy parts of kubernetes-mixin, rendered with the mixin's default configuration
// (render.sh runs it): the Proxy dashboard and the alert group kubernetes-system-kube-proxy.
local mixin = import 'mixin.libsonnet';
{
  'proxy.json': std.manifestJsonEx(mixin.grafanaDashboards['proxy.json'], '  ') + '\n',
  'kube-proxy-alerts.yaml': std.manifestYamlDoc({
    groups: [g for g in mixin.prometheusAlerts.groups if g.name == 'kubernetes-system-kube-proxy'],
  }) + '\n',
}
