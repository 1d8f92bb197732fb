// Package sys is the data path's interface to the kernel below package net: raw non-blocking
// system calls for the event loops (Read, Write, Splice, Connect, EpollCtl, ...: RawSyscall,
// so that a loop's calls never wake the runtime's monitor thread; see raw_linux.go), socket
// addresses in the kernel's encoding (EncodeSockaddr, RawAddrPort, ParseSockaddr), a
// connection's original destination from conntrack (OriginalDst: SO_ORIGINAL_DST; and the
// IP_RECVORIGDSTADDR and IP_PKTINFO control messages of UDP), transparent dialing from a
// client's address (IP_TRANSPARENT: DialUDPFrom, ErrTransparentSetup), and the descriptors of
// sockets and files (FD, DupFile, FDFromFile).
//
// Everything but FD and UnmapAddrPort is Linux's; the engines (packages proxy/forward/tcp and
// udp) use it from their _linux files only.
package sys
