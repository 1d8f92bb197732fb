package portalloc

import (
	"errors"
	"math/rand/v2"
	"os"
	"testing"
)

func TestParseRange(t *testing.T) {
	tests := []struct {
		in      string
		want    Range
		wantErr bool
	}{
		{in: "", want: Range{}},
		{in: "0", want: Range{}},
		{in: "0-0", want: Range{}},
		{in: "40000-40000", want: Range{Base: 40000, Size: 1}},
		{in: "30000-32767", want: Range{Base: 30000, Size: 2768}},
		{in: "30000+10", want: Range{Base: 30000, Size: 11}},
		{in: "8080", want: Range{Base: 8080, Size: 1}},
		{in: " 1-2 ", want: Range{Base: 1, Size: 2}},
		{in: "2-1", wantErr: true},
		{in: "a-b", wantErr: true},
		{in: "70000", wantErr: true},
		{in: "65530+10", wantErr: true},
		{in: "100+-1", wantErr: true},
		{in: "-5", wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.in, func(t *testing.T) {
			got, err := ParseRange(tc.in)
			if (err != nil) != tc.wantErr {
				t.Fatalf("ParseRange(%q) error = %v, wantErr %v", tc.in, err, tc.wantErr)
			}
			if err == nil && got != tc.want {
				t.Fatalf("ParseRange(%q) = %+v, want %+v", tc.in, got, tc.want)
			}
		})
	}
}

func TestAllocatorExhaustionAndRelease(t *testing.T) {
	a := NewAllocator(Range{Base: 100, Size: 5}, rand.New(rand.NewPCG(1, 2)))
	seen := map[int]bool{}
	for range 5 {
		p, err := a.Allocate()
		if err != nil {
			t.Fatal(err)
		}
		if p < 100 || p > 104 || seen[p] {
			t.Fatalf("bad or duplicate port %d (seen %v)", p, seen)
		}
		seen[p] = true
	}
	if _, err := a.Allocate(); !errors.Is(err, ErrExhausted) {
		t.Fatalf("want ErrExhausted, got %v", err)
	}
	a.Release(102)
	a.Release(9999) // outside: ignored
	if p, err := a.Allocate(); err != nil || p != 102 {
		t.Fatalf("after release got %d, %v; want 102", p, err)
	}
	if a.InUse() != 5 {
		t.Fatalf("InUse = %d", a.InUse())
	}
}

// TestAllocatorRandomisedReuse: a released port is not always the next one handed out.
func TestAllocatorRandomisedReuse(t *testing.T) {
	a := NewAllocator(Range{Base: 1000, Size: 100}, rand.New(rand.NewPCG(3, 4)))
	p, _ := a.Allocate()
	same := 0
	for range 50 {
		a.Release(p)
		q, err := a.Allocate()
		if err != nil {
			t.Fatal(err)
		}
		if q == p {
			same++
		}
		p = q
	}
	if same > 10 {
		t.Errorf("released port reused immediately %d/50 times", same)
	}
}

func TestZeroRangeLetsKernelChoose(t *testing.T) {
	a := NewAllocator(Range{}, nil)
	if p, err := a.Allocate(); p != 0 || err != nil {
		t.Fatalf("got %d, %v", p, err)
	}
	a.Release(0)
}

func FuzzParseRange(f *testing.F) {
	for _, s := range []string{"", "1-2", "3+4", "5", "x", "65535+0", "1-65535"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := ParseRange(s)
		if err != nil {
			return
		}
		if r.Size < 0 || (r.Size > 0 && (r.Base < 1 || r.Base+r.Size-1 > 65535)) {
			t.Fatalf("ParseRange(%q) = %+v out of bounds", s, r)
		}
	})
}

func TestLocalPortRange(t *testing.T) {
	dir := t.TempDir() + "/"
	if err := os.WriteFile(dir+"ip_local_port_range", []byte("32768\t32777\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dir+"ip_local_reserved_ports", []byte("80,32770-32772,40000\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	r, skip, err := localPortRange(dir)
	if err != nil || r != (Range{Base: 32768, Size: 10}) || len(skip) != 3 || !skip[32771] {
		t.Fatalf("got %v %v %v", r, skip, err)
	}
	a := NewAllocator(r, nil)
	a.skip = skip
	for range 7 {
		p, err := a.Allocate()
		if err != nil || skip[p] || !r.Contains(p) {
			t.Fatalf("got %d, %v", p, err)
		}
	}
	if _, err := a.Allocate(); !errors.Is(err, ErrExhausted) {
		t.Fatalf("want ErrExhausted, got %v", err)
	}
	if a := NewLocalAllocator(nil); a.Range().Size == 0 {
		t.Error("NewLocalAllocator: no range read from /proc")
	}
}

// Reserve takes a given free port of the range, and nothing else; Release gives it back.
func TestReserve(t *testing.T) {
	a := NewAllocator(Range{Base: 100, Size: 3}, rand.New(rand.NewPCG(5, 6)))
	a.skip = map[int]bool{102: true}
	for _, tc := range []struct {
		port int
		want bool
	}{{101, true}, {101, false}, {99, false}, {103, false}, {102, false}, {0, false}} {
		if got := a.Reserve(tc.port); got != tc.want {
			t.Errorf("Reserve(%d) = %v, want %v", tc.port, got, tc.want)
		}
	}
	if p, err := a.Allocate(); err != nil || p != 100 {
		t.Errorf("Allocate = %d, %v; want 100, the only port left", p, err)
	}
	a.Release(101)
	if !a.Reserve(101) {
		t.Error("Reserve(101) after Release = false")
	}
	z := NewAllocator(Range{}, nil)
	first, again := z.Reserve(40000), z.Reserve(40000)
	if !first || !again || z.Reserve(0) || z.Reserve(65536) {
		t.Error("the zero Range: Reserve should say yes to every port 1..65535 (the bind decides)")
	}
}

// Allocate hands out ports set aside only when no other port is free; Reserve takes them.
func TestSetAside(t *testing.T) {
	a := NewAllocator(Range{Base: 100, Size: 10}, rand.New(rand.NewPCG(7, 8)))
	aside := []int{100, 103, 105, 109, 4000}
	a.SetAside(aside)
	got := map[int]bool{}
	for range 6 {
		p, err := a.Allocate()
		if err != nil {
			t.Fatal(err)
		}
		got[p] = true
	}
	for _, p := range aside {
		if got[p] {
			t.Errorf("port %d, set aside, handed out while others were free (got %v)", p, got)
		}
	}
	if !a.Reserve(103) {
		t.Error("Reserve(103), set aside and free, = false")
	}
	for range 3 {
		if _, err := a.Allocate(); err != nil {
			t.Errorf("Allocate with only ports set aside left: %v", err)
		}
	}
	if _, err := a.Allocate(); !errors.Is(err, ErrExhausted) {
		t.Errorf("want ErrExhausted, got %v", err)
	}
}
