//go:build twell_noembed

package models

import (
	"fmt"
	"os"
	"path/filepath"
)

// Default returns the models/default folder of the source tree that holds
// the working folder or the executable (inTree): this build (tag
// twell_noembed) does not embed the default model.
func Default() (string, error) {
	var starts []string
	if wd, err := os.Getwd(); err == nil {
		starts = append(starts, wd)
	}
	if exe, err := os.Executable(); err == nil {
		starts = append(starts, filepath.Dir(exe))
	}
	dir, err := inTree(starts...)
	if err != nil {
		return "", fmt.Errorf("%w: this twell was built without the default model (tag twell_noembed); run it inside the source tree or pass -model", err)
	}
	return dir, nil
}
