package main

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
)

// allocator hands out the addresses of a pool, one owner (a Service's namespace/name) per
// address and one address per owner. It is not safe for concurrent use: the controller's one
// worker owns it.
type allocator struct {
	pool        netip.Prefix
	first, last netip.Addr // the addresses handed out: all of the pool's but its network and broadcast addresses
	byAddr      map[netip.Addr]string
	byKey       map[string]netip.Addr
}

// errPoolFull is returned when every address of the pool has an owner.
var errPoolFull = errors.New("no free address left")

// newAllocator returns an allocator of the IPv4 prefix pool's addresses but its first (the
// network's) and its last (the broadcast address).
func newAllocator(pool netip.Prefix) (*allocator, error) {
	pool = pool.Masked()
	if !pool.Addr().Is4() || pool.Bits() > 30 {
		return nil, fmt.Errorf("pool %s: want an IPv4 prefix of at least 4 addresses", pool)
	}
	b := pool.Addr().As4()
	hosts := uint32(1)<<(32-pool.Bits()) - 1
	binary.BigEndian.PutUint32(b[:], (binary.BigEndian.Uint32(b[:])|hosts)-1) // before the broadcast address
	return &allocator{pool: pool, first: pool.Addr().Next(), last: netip.AddrFrom4(b),
		byAddr: map[netip.Addr]string{}, byKey: map[string]netip.Addr{}}, nil
}

// usable reports whether ip is an address the pool hands out.
func (a *allocator) usable(ip netip.Addr) bool {
	return ip.Is4() && a.first.Compare(ip) <= 0 && ip.Compare(a.last) <= 0
}

// free reports whether ip can be key's: usable and without another owner.
func (a *allocator) free(key string, ip netip.Addr) bool {
	owner, taken := a.byAddr[ip]
	return a.usable(ip) && (!taken || owner == key)
}

// Lookup returns key's address, if it has one.
func (a *allocator) Lookup(key string) (netip.Addr, bool) {
	ip, ok := a.byKey[key]
	return ip, ok
}

// Assign gives key an address and returns it. requested (spec.loadBalancerIP; the zero Addr for
// none) is binding: key gets it when it is usable and free, and an error otherwise (key keeps
// what it had: the caller releases it). Without a request key keeps the address it has; without
// one it takes the first of current (the addresses its status already shows) that is usable
// and free, else the lowest free address of the pool.
func (a *allocator) Assign(key string, requested netip.Addr, current []netip.Addr) (netip.Addr, error) {
	if requested.IsValid() {
		requested = requested.Unmap()
		switch {
		case !a.usable(requested):
			return netip.Addr{}, fmt.Errorf("requested address %s is not in the pool %s (or is its network or broadcast address)", requested, a.pool)
		case !a.free(key, requested):
			return netip.Addr{}, fmt.Errorf("requested address %s is already assigned to %s", requested, a.byAddr[requested])
		}
		a.take(key, requested)
		return requested, nil
	}
	if ip, ok := a.byKey[key]; ok {
		return ip, nil
	}
	for _, ip := range current {
		if ip = ip.Unmap(); a.free(key, ip) {
			a.take(key, ip)
			return ip, nil
		}
	}
	for ip := a.first; a.usable(ip); ip = ip.Next() {
		if _, taken := a.byAddr[ip]; !taken {
			a.take(key, ip)
			return ip, nil
		}
	}
	return netip.Addr{}, fmt.Errorf("pool %s: %w", a.pool, errPoolFull)
}

// take makes ip key's, releasing the address key had.
func (a *allocator) take(key string, ip netip.Addr) {
	a.Release(key)
	a.byAddr[ip] = key
	a.byKey[key] = ip
}

// Release frees key's address, if it has one.
func (a *allocator) Release(key string) {
	if ip, ok := a.byKey[key]; ok {
		delete(a.byAddr, ip)
		delete(a.byKey, key)
	}
}

// Owner returns who has ip ("" for nobody).
func (a *allocator) Owner(ip netip.Addr) string { return a.byAddr[ip.Unmap()] }
