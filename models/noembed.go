//go:build twell_noembed

package models

import (
	"embed"
	"fmt"
	"os"
	"path/filepath"
)

// files is empty: this build leaves the default model out.
var files embed.FS

// Default returns the models/default folder of the source tree that holds
// the working folder or the executable (InTree): this build (tag
// twell_noembed) does not embed the default model.
func Default() (string, error) {
	var starts []string
	if wd, err := os.Getwd(); err == nil {
		starts = append(starts, wd)
	}
	if exe, err := os.Executable(); err == nil {
		starts = append(starts, filepath.Dir(exe))
	}
	dir, err := InTree(starts...)
	if err != nil {
		return "", fmt.Errorf("%w: this twell was built without the default model (tag twell_noembed); run it inside the source tree or pass -model", err)
	}
	return dir, nil
}
