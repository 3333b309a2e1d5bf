package main

import (
	"fmt"
	"io"

	"github.com/twell-ai/twell/model"
	"github.com/twell-ai/twell/models"
	"github.com/twell-ai/twell/tokenizer"
)

// loadCheckpointOrDefault loads the checkpoint in dir, or the default
// model (with a note on stderr) when dir is empty, for a command that only
// runs it (generate, serve): see loadCheckpoint's runOnly.
func loadCheckpointOrDefault(cmd, dir string, stderr io.Writer) (*model.Model, *tokenizer.Tokenizer, error) {
	if dir == "" {
		d, err := models.Default()
		if err != nil {
			return nil, nil, err
		}
		fmt.Fprintf(stderr, "%s: no -model given: using the default model %s (models/default in the source tree)\n", cmd, models.DefaultName)
		dir = d
	}
	return loadCheckpoint(dir, true)
}
