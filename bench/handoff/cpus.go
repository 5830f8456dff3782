package handoff

import (
	"fmt"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// ParseCPUs reads a CPU list in taskset's syntax ("0-7", "0,2,4-6").
func ParseCPUs(list string) (*unix.CPUSet, error) {
	var set unix.CPUSet
	for _, part := range strings.Split(list, ",") {
		lo, hi, isRange := strings.Cut(part, "-")
		a, err := strconv.Atoi(lo)
		b := a
		if err == nil && isRange {
			b, err = strconv.Atoi(hi)
		}
		if err != nil || a < 0 || b < a || b >= runtime.NumCPU() {
			return nil, fmt.Errorf("CPU list %q: %q is not a CPU or range of this machine's %d", list, part, runtime.NumCPU())
		}
		for c := a; c <= b; c++ {
			set.Set(c)
		}
	}
	return &set, nil
}

// OtherCPUs is the list of this machine's CPUs not in set, in taskset's syntax.
func OtherCPUs(set *unix.CPUSet) string {
	var out []string
	for c := range runtime.NumCPU() {
		if !set.IsSet(c) {
			out = append(out, strconv.Itoa(c))
		}
	}
	return strings.Join(out, ",")
}

// pinned runs fn on a thread of its own bound to cpus (nil: anywhere), as the agents'
// threads are: a floor measured on other cores than the agents' would not bound them.
func pinned(cpus *unix.CPUSet, fn func()) {
	if cpus == nil {
		fn()
		return
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var was unix.CPUSet
	if err := unix.SchedGetaffinity(0, &was); err == nil {
		defer unix.SchedSetaffinity(0, &was) // the thread goes back to the pool as it was
	}
	_ = unix.SchedSetaffinity(0, cpus)
	fn()
}
