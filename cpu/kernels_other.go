//go:build !amd64

package cpu

func useSIMD(on bool) {}

func simdAvailable() bool { return false }
