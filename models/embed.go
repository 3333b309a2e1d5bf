//go:build !twell_noembed

package models

import "embed"

// files holds models/default, embedded in the binary.
//
//go:embed default
var files embed.FS

// Default returns a folder holding the default model's checkpoint
// (config.json, model.safetensors, tokenizer.json and the rest), as
// model.Load and tokenizer.Load read it. The embedded files are written once
// into the user's cache folder (under twell/models, named by a hash of their
// contents) and reused from there; a damaged copy is written again.
func Default() (string, error) { return materializeDefault() }
