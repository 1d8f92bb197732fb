//go:build race

package portal

// raceBuild: the race detector is on. sync.Pool then drops a quarter of what is Put, at random,
// so allocation counts of code that reuses through a pool are averages, not exact.
const raceBuild = true
