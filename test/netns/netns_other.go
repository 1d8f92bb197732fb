//go:build !linux

// Network namespaces are Linux's: elsewhere this package is empty, and the tests that use it
// are of the Linux tiers.

package netns
