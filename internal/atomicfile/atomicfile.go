// Package atomicfile writes files so that a reader, or a crash, never sees a
// half-written one: data goes to a temporary file in the same folder, which
// is synced and then renamed over the destination.
package atomicfile

import (
	"io"
	"os"
	"path/filepath"
)

// Write creates path with permissions perm from what fill writes. On any
// error the destination is left as it was and the temporary file removed.
func Write(path string, perm os.FileMode, fill func(w io.Writer) error) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	err = fill(f)
	if err == nil {
		err = f.Chmod(perm)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	if err != nil {
		os.Remove(f.Name())
		return err
	}
	SyncDir(dir)
	return nil
}

// WriteFile writes data to path atomically, with permissions 0644.
func WriteFile(path string, data []byte) error {
	return Write(path, 0o644, func(w io.Writer) error {
		_, err := w.Write(data)
		return err
	})
}

// SyncDir makes a rename inside dir durable where the platform allows it;
// failures are ignored, as not every file system supports syncing folders.
func SyncDir(dir string) {
	if d, err := os.Open(dir); err == nil {
		d.Sync()
		d.Close()
	}
}
