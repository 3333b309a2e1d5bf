package main

import (
	"bytes"
	"encoding/json"
	"flag"
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

// tokenizerAndStdin parses the flags of the tokenizer command name: the
// required -tokenizer and those that addFlags defines. It returns the
// tokenizer and all of stdin, which holds what.
func tokenizerAndStdin(name string, args []string, stderr io.Writer, what string, addFlags func(*flag.FlagSet)) (*tokenizer.Tokenizer, []byte, error) {
	fs := newFlagSet(name, stderr)
	path := fs.String("tokenizer", "", "Hugging Face tokenizer.json file (.json.gz is read too); required")
	addFlags(fs)
	if err := parseFlags(fs, args); err != nil {
		return nil, nil, err
	}
	if *path == "" {
		return nil, nil, usagef("-tokenizer FILE is required (%s is read from stdin)", what)
	}
	tk, err := tokenizer.Load(*path)
	if err != nil {
		return nil, nil, err
	}
	in, err := io.ReadAll(os.Stdin)
	if err != nil {
		return nil, nil, fmt.Errorf("reading stdin: %w", err)
	}
	return tk, in, nil
}

// runTokenizerEncode reads all of stdin as the text (a trailing newline is part of it) and
// prints its ids as one JSON array.
func runTokenizerEncode(args []string, stdout, stderr io.Writer) error {
	var addSpecial *bool
	tk, text, err := tokenizerAndStdin("tokenizer encode", args, stderr, "the text", func(fs *flag.FlagSet) {
		addSpecial = fs.Bool("add-special", true, "add the special tokens of the post-processor's template (e.g. Llama 2's leading <s>), as Hugging Face's encode does by default")
	})
	if err != nil {
		return err
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
	var skipSpecial *bool
	tk, in, err := tokenizerAndStdin("tokenizer decode", args, stderr, "the ids", func(fs *flag.FlagSet) {
		skipSpecial = fs.Bool("skip-special", false, "leave special tokens such as <s> out of the text (Hugging Face's skip_special_tokens)")
	})
	if err != nil {
		return err
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
