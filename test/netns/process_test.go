//go:build linux

package netns

import "testing"

func TestGoroutineDigest(t *testing.T) {
	dump := `SIGQUIT: quit
PC=0x47e1a1 m=0 sigcode=0

goroutine 0 gp=0x1 m=0 mp=0x2 [idle]:
runtime.futex(0x0)

goroutine 12 [semacquire, 3 minutes]:
sync.runtime_SemacquireMutex(0xc0001, 0x0, 0x1)
	/usr/local/go/src/runtime/sema.go:95 +0x25
github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/userspace.(*Proxier).sync(0xc000100000, 0x1)
	/src/proxy/userspace/proxier.go:270 +0x1f
github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/syncrunner.(*Runner).Run.func1()
	/src/proxy/syncrunner/runner.go:80 +0x2c
created by github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/syncrunner.(*Runner).Run in goroutine 1

goroutine 30 [IO wait]:
internal/poll.runtime_pollWait(0x7f, 0x72)
	/usr/local/go/src/runtime/netpoll.go:351 +0x85
`
	got := goroutineDigest(dump, modulePath)
	want := "goroutine 12 [semacquire, 3 minutes] proxy/userspace.(*Proxier).sync < proxy/syncrunner.(*Runner).Run.func1\n(2 goroutines without a frame of this module)"
	if got != want {
		t.Errorf("digest:\n%s\nwant:\n%s", got, want)
	}
}
