// Package forwardtest holds what the tests of the data path's packages (proxy/forward and the
// packages below it) share: loopback TCP and UDP echo backends and clients, a Metrics that
// counts, the leak check of the proxies' goroutines, a logger to the test's output, bounded
// waits (Eventually), and copies of the test binary run as child processes. Only tests import
// it.
package forwardtest
