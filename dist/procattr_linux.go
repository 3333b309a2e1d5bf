package dist

import "syscall"

// sysProcAttr puts a rank in a process group of its own and has the kernel
// kill it when the launcher dies, however it dies.
func sysProcAttr() (*syscall.SysProcAttr, error) {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}, nil
}
