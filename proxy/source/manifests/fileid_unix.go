//go:build unix

package manifests

import (
	"os"
	"syscall"
)

// fileID returns the inode and device numbers of fi (zero when the stat has none).
func fileID(fi os.FileInfo) (ino, dev uint64) {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return uint64(st.Ino), uint64(st.Dev)
	}
	return 0, 0
}
