package data

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// Source is one named body of text: files and folders on disk, documents in memory, or both.
// Build holds out the last documents of each source for validation and reports statistics
// per source.
//
// Paths may name text files (one document per file), JSONL files (extension .jsonl; one
// document per line, in the string field "text") and folders, which are searched recursively
// for .txt, .md and .jsonl files in lexical order, skipping names that start with a dot.
// Docs are taken after the files, in order.
type Source struct {
	Name  string
	Paths []string
	Docs  []string
}

// SourcesFromPaths turns command-line inputs into sources, one per argument. An argument
// NAME=PATH names its source; otherwise the source is named after the last path element,
// without its extension (a repeated name gets a suffix -2, -3, ...). A folder that holds a
// MANIFEST written by scripts/fetch-corpus becomes one source per folder the MANIFEST lists.
func SourcesFromPaths(args []string) ([]Source, error) {
	var out []Source
	used := map[string]int{}
	add := func(name, path string) {
		if name == "" || name == "." || name == string(filepath.Separator) {
			name = "input"
		}
		base := name
		for used[name] > 0 {
			used[base]++
			name = fmt.Sprintf("%s-%d", base, used[base])
		}
		used[name]++
		out = append(out, Source{Name: name, Paths: []string{path}})
	}
	for _, a := range args {
		name, path, named := strings.Cut(a, "=")
		if !named || path == "" || strings.ContainsAny(name, `/\`) {
			name, path, named = "", a, false
		}
		if path == "" {
			return nil, errors.New("data: empty input path")
		}
		st, err := os.Stat(path)
		if err != nil {
			return nil, fmt.Errorf("data: input %w", err)
		}
		if !named && st.IsDir() {
			folders, err := readManifest(path)
			if err != nil {
				return nil, err
			}
			if folders != nil {
				for _, f := range folders {
					add(f, filepath.Join(path, f))
				}
				continue
			}
		}
		if !named {
			name = filepath.Base(filepath.Clean(path))
			if !st.IsDir() {
				name = strings.TrimSuffix(name, filepath.Ext(name))
			}
		}
		add(name, path)
	}
	return out, nil
}

// readManifest returns the source folders listed in dir/MANIFEST (scripts/fetch-corpus
// format: tab-separated, folder first, # comments), or nil when there is no MANIFEST.
func readManifest(dir string) ([]string, error) {
	b, err := os.ReadFile(filepath.Join(dir, "MANIFEST"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("data: %w", err)
	}
	folders := []string{}
	for i, line := range strings.Split(string(b), "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f, _, _ := strings.Cut(line, "\t")
		if f == "" || strings.ContainsAny(f, `/\`) || f == "." || f == ".." {
			return nil, fmt.Errorf("data: %s line %d: bad folder name %q", filepath.Join(dir, "MANIFEST"), i+1, f)
		}
		if st, err := os.Stat(filepath.Join(dir, f)); err != nil || !st.IsDir() {
			return nil, fmt.Errorf("data: %s line %d: folder %s is missing", filepath.Join(dir, "MANIFEST"), i+1, filepath.Join(dir, f))
		}
		folders = append(folders, f)
	}
	if len(folders) == 0 {
		return nil, fmt.Errorf("data: %s lists no sources", filepath.Join(dir, "MANIFEST"))
	}
	return folders, nil
}

// inputFiles lists the files of a source's paths: a file as given, a folder's .txt, .md and
// .jsonl files recursively in lexical order.
func inputFiles(src Source) ([]string, error) {
	var files []string
	for _, p := range src.Paths {
		st, err := os.Stat(p)
		if err != nil {
			return nil, fmt.Errorf("data: source %s: %w", src.Name, err)
		}
		if !st.IsDir() {
			files = append(files, p)
			continue
		}
		n := len(files)
		err = filepath.WalkDir(p, func(path string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if path != p && strings.HasPrefix(d.Name(), ".") {
				if d.IsDir() {
					return filepath.SkipDir
				}
				return nil
			}
			if d.Type().IsRegular() {
				switch strings.ToLower(filepath.Ext(path)) {
				case ".txt", ".md", ".jsonl":
					files = append(files, path)
				}
			}
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("data: source %s: %w", src.Name, err)
		}
		if len(files) == n {
			return nil, fmt.Errorf("data: source %s: no .txt, .md or .jsonl files under %s", src.Name, p)
		}
	}
	return files, nil
}

// isJSONL reports whether a file is read as JSON lines.
func isJSONL(path string) bool { return strings.EqualFold(filepath.Ext(path), ".jsonl") }

// eachDoc calls fn with every document of the files and then of docs, in order, with a
// location for messages ("file", "file:line" or "source[i]").
func eachDoc(name string, files []string, docs []string, fn func(loc, text string) error) error {
	for _, f := range files {
		if isJSONL(f) {
			if err := eachJSONLDoc(f, fn); err != nil {
				return err
			}
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			return fmt.Errorf("data: %w", err)
		}
		if err := fn(f, string(b)); err != nil {
			return err
		}
	}
	for i, d := range docs {
		if err := fn(fmt.Sprintf("%s[%d]", name, i), d); err != nil {
			return err
		}
	}
	return nil
}

// eachJSONLDoc reads a JSONL file: one object per line with a string field "text". Blank
// lines are skipped; anything else that is not such an object is an error naming the line.
func eachJSONLDoc(path string, fn func(loc, text string) error) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("data: %w", err)
	}
	defer f.Close()
	r := bufio.NewReaderSize(f, 1<<20)
	for line := 1; ; line++ {
		b, err := r.ReadBytes('\n')
		if err != nil && err != io.EOF {
			return fmt.Errorf("data: %s:%d: %w", path, line, err)
		}
		if t := bytes.TrimSpace(b); len(t) > 0 {
			var rec map[string]json.RawMessage
			if jerr := json.Unmarshal(t, &rec); jerr != nil {
				return fmt.Errorf("data: %s:%d: not a JSON object: %v", path, line, jerr)
			}
			raw, ok := rec["text"]
			if !ok {
				return fmt.Errorf("data: %s:%d: no \"text\" field", path, line)
			}
			var text string
			if jerr := json.Unmarshal(raw, &text); jerr != nil || string(raw) == "null" {
				return fmt.Errorf("data: %s:%d: field \"text\" is not a string", path, line)
			}
			if ferr := fn(fmt.Sprintf("%s:%d", path, line), text); ferr != nil {
				return ferr
			}
		}
		if err == io.EOF {
			return nil
		}
	}
}

// Documents calls fn with every document of the source as it is in the input (not
// normalized), in the order Build reads them, with its location for messages ("file",
// "file:line" or "name[i]"). It stops at the first error.
func (s Source) Documents(fn func(loc, text string) error) error {
	files, err := inputFiles(s)
	if err != nil {
		return err
	}
	return eachDoc(s.Name, files, s.Docs, fn)
}
