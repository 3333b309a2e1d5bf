package main

import (
	"fmt"
	"io"

	"github.com/twell-ai/twell/models"
)

// checkpointDir returns dir, or the default model's folder (with a note on
// stderr) when dir is empty.
func checkpointDir(cmd, dir string, stderr io.Writer) (string, error) {
	if dir != "" {
		return dir, nil
	}
	d, err := models.Default()
	if err != nil {
		return "", err
	}
	fmt.Fprintf(stderr, "%s: no -model given: using the default model %s (models/default in the source tree)\n", cmd, models.DefaultName)
	return d, nil
}
