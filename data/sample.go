package data

import (
	"embed"
	"io/fs"
	"sort"
	"strings"
)

//go:embed sample/*.txt
var sampleFS embed.FS

// SampleFile is one document of the bundled text sample.
type SampleFile struct {
	Name string // file name, e.g. "carroll-alice-01.txt"
	Text string
}

// SampleFiles returns the bundled public-domain sample (about 470 KB of children's stories
// from Project Gutenberg; see data/sample/README.md), one chapter or story per file, sorted by
// name.
func SampleFiles() []SampleFile {
	names, err := fs.Glob(sampleFS, "sample/*.txt")
	if err != nil {
		panic(err) // the pattern is constant and valid
	}
	sort.Strings(names)
	out := make([]SampleFile, 0, len(names))
	for _, n := range names {
		b, err := sampleFS.ReadFile(n)
		if err != nil {
			panic(err) // embedded files are always readable
		}
		out = append(out, SampleFile{Name: strings.TrimPrefix(n, "sample/"), Text: string(b)})
	}
	return out
}

// Sample returns the whole bundled sample as one text, the files in name order separated by
// a blank line.
func Sample() string {
	var sb strings.Builder
	for i, f := range SampleFiles() {
		if i > 0 {
			sb.WriteString("\n")
		}
		sb.WriteString(f.Text)
	}
	return sb.String()
}

// SampleSource returns the bundled sample as a build Source named "sample", one document per
// file.
func SampleSource() Source {
	files := SampleFiles()
	docs := make([]string, len(files))
	for i, f := range files {
		docs[i] = f.Text
	}
	return Source{Name: "sample", Docs: docs}
}
