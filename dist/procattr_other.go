//go:build !linux

package dist

import (
	"errors"
	"syscall"
)

// sysProcAttr refuses: without Linux's parent-death signal the ranks of a
// launcher that dies would run on.
func sysProcAttr() (*syscall.SysProcAttr, error) {
	return nil, errors.New("dist: launching ranks needs Linux")
}
