package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"

	"github.com/twell-ai/twell/tokenizer"
)

func init() {
	register(command{
		name:    "tokenizer encode",
		summary: "token ids (a JSON array) of the text on stdin, with a tokenizer.json",
		run:     runTokenizerEncode,
	})
	register(command{
		name:    "tokenizer decode",
		summary: "text of the token ids (a JSON array) on stdin, with a tokenizer.json",
		run:     runTokenizerDecode,
	})
}

// runTokenizerEncode reads all of stdin as the text (a trailing newline is part of it) and
// prints its ids as one JSON array.
func runTokenizerEncode(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("tokenizer encode", stderr)
	path := fs.String("tokenizer", "", "Hugging Face tokenizer.json file (.json.gz is read too); required")
	addSpecial := fs.Bool("add-special", true, "add the special tokens of the post-processor's template (e.g. Llama 2's leading <s>), as Hugging Face's encode does by default")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *path == "" {
		return usagef("-tokenizer FILE is required (the text is read from stdin)")
	}
	tk, err := tokenizer.Load(*path)
	if err != nil {
		return err
	}
	text, err := io.ReadAll(os.Stdin)
	if err != nil {
		return fmt.Errorf("reading stdin: %w", err)
	}
	ids, err := tk.Encode(string(text), *addSpecial)
	if err != nil {
		return fmt.Errorf("stdin: %w", err)
	}
	if ids == nil {
		ids = []int{}
	}
	out, err := json.Marshal(ids)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(stdout, "%s\n", out)
	return err
}

// runTokenizerDecode reads a JSON array of ids from stdin and prints their text, exactly (no
// newline is added).
func runTokenizerDecode(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("tokenizer decode", stderr)
	path := fs.String("tokenizer", "", "Hugging Face tokenizer.json file (.json.gz is read too); required")
	skipSpecial := fs.Bool("skip-special", false, "leave special tokens such as <s> out of the text (Hugging Face's skip_special_tokens)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *path == "" {
		return usagef("-tokenizer FILE is required (the ids are read from stdin)")
	}
	tk, err := tokenizer.Load(*path)
	if err != nil {
		return err
	}
	in, err := io.ReadAll(os.Stdin)
	if err != nil {
		return fmt.Errorf("reading stdin: %w", err)
	}
	var ids []int
	dec := json.NewDecoder(bytes.NewReader(in))
	if err := dec.Decode(&ids); err != nil {
		return fmt.Errorf("stdin: want a JSON array of token ids, e.g. [1, 15043]: %v", err)
	}
	if dec.More() {
		return fmt.Errorf("stdin: unexpected data after the JSON array of token ids")
	}
	text, err := tk.Decode(ids, *skipSpecial)
	if err != nil {
		return err
	}
	_, err = io.WriteString(stdout, text)
	return err
}
