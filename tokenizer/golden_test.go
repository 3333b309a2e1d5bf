package tokenizer

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// goldenFile is testdata/goldens.json, written by scripts/tokenizer-goldens.py with Hugging
// Face tokenizers.
type goldenFile struct {
	Version   string                  `json:"tokenizers_version"`
	BulkTexts []string                `json:"bulk_texts"`
	Configs   map[string]goldenConfig `json:"configs"`
}

type goldenConfig struct {
	Error       string          `json:"error"`
	VocabSize   int             `json:"vocab_size"`
	AddedIDs    map[string]*int `json:"added_ids"`
	Cases       []goldenCase    `json:"cases"`
	DecodeCases []goldenDecode  `json:"decode_cases"`
	BulkHashes  []string        `json:"bulk_hashes"`
}

type goldenCase struct {
	Error       string    `json:"error"`
	IDs         []int     `json:"ids"`
	IDsPlain    []int     `json:"ids_plain"`
	TokensPlain []string  `json:"tokens_plain"`
	Decoded     *string   `json:"decoded"`
	DecodedSkip *string   `json:"decoded_skip"`
	Pieces      *[]string `json:"pieces"`
}

type goldenDecode struct {
	IDs      []int   `json:"ids"`
	Text     *string `json:"text"`
	TextSkip *string `json:"text_skip"`
	Error    string  `json:"error"`
}

const goldenCommand = "python3 scripts/tokenizer-goldens.py goldens   # on a machine with HF tokenizers (e.g. the GPU machine), from the repository root"

func readGoldens(t *testing.T) *goldenFile {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "goldens.json"))
	if errors.Is(err, fs.ErrNotExist) {
		t.Skip("testdata/goldens.json is missing, so ids are not compared with Hugging Face tokenizers; make it with: " + goldenCommand)
	}
	if err != nil {
		t.Fatal(err)
	}
	var g goldenFile
	if err := json.Unmarshal(b, &g); err != nil {
		t.Fatalf("goldens.json: %v", err)
	}
	return &g
}

// idsHash is ids_hash of scripts/tokenizer-goldens.py.
func idsHash(ids []int) string {
	parts := make([]string, len(ids))
	for i, id := range ids {
		parts[i] = strconv.Itoa(id)
	}
	sum := sha256.Sum256([]byte(strings.Join(parts, ",")))
	return hex.EncodeToString(sum[:])[:16]
}

// TestGoldens compares ids and decoded text with Hugging Face tokenizers for every variant of
// testdata/variants.json on every text of testdata/texts.json, plus the random bulk texts.
func TestGoldens(t *testing.T) {
	g := readGoldens(t)
	texts := readTexts(t)
	for _, v := range readVariants(t) {
		t.Run(v.Name, func(t *testing.T) {
			gc, ok := g.Configs[v.Name]
			if !ok {
				t.Fatalf("goldens.json has no config %q (regenerate it: %s)", v.Name, goldenCommand)
			}
			if gc.Error != "" {
				t.Skipf("Hugging Face could not load this variant: %s", gc.Error)
			}
			tk := testTokenizer(t, v.Name)
			if tk.VocabSize() != gc.VocabSize {
				t.Errorf("VocabSize() = %d, Hugging Face get_vocab_size(True) = %d", tk.VocabSize(), gc.VocabSize)
			}
			for content, want := range gc.AddedIDs {
				got, ok := tk.TokenID(content)
				if want != nil && (!ok || got != *want) {
					t.Errorf("TokenID(%q) = %d, %v; Hugging Face %d", content, got, ok, *want)
				}
			}
			if len(gc.Cases) != len(texts) {
				t.Fatalf("goldens.json has %d cases for %d texts (regenerate it: %s)", len(gc.Cases), len(texts), goldenCommand)
			}
			failed := 0
			report := func(format string, a ...any) {
				failed++
				if failed <= 8 {
					t.Errorf(format, a...)
				}
			}
			for i, c := range gc.Cases {
				if c.Error != "" {
					continue
				}
				text := texts[i]
				ids, err := tk.Encode(text, true)
				if err != nil || !slices.Equal(ids, c.IDs) {
					report("text %d %q: Encode(add special) = %v, %v\n  want %v", i, text, ids, err, c.IDs)
				}
				plain, err := tk.Encode(text, false)
				if err != nil || !slices.Equal(plain, c.IDsPlain) {
					report("text %d %q: Encode = %v, %v\n  want %v\n  tokens %q", i, text, plain, err, c.IDsPlain, c.TokensPlain)
				}
				checkDecode(report, tk, fmt.Sprintf("text %d", i), c.IDs, c.Decoded, c.DecodedSkip)
				if c.Pieces != nil {
					for k, id := range c.IDsPlain[:len(*c.Pieces)] {
						got, err := tk.Decode([]int{id}, false)
						if want := (*c.Pieces)[k]; err != nil || got != want {
							report("text %d: Decode([%d]) = %q, %v; want %q", i, id, got, err, want)
						}
					}
				}
			}
			for i, d := range gc.DecodeCases {
				if d.Error == "" {
					checkDecode(report, tk, fmt.Sprintf("decode case %d %v", i, d.IDs), d.IDs, d.Text, d.TextSkip)
				}
			}
			if len(gc.BulkHashes) != len(g.BulkTexts) {
				t.Fatalf("goldens.json has %d bulk hashes for %d bulk texts", len(gc.BulkHashes), len(g.BulkTexts))
			}
			bulkFailed := 0
			for i, want := range gc.BulkHashes {
				if strings.HasPrefix(want, "error") {
					continue
				}
				ids, err := tk.Encode(g.BulkTexts[i], false)
				if got := idsHash(ids); err != nil || got != want {
					bulkFailed++
					report("bulk text %d %q: ids %v (hash %s, error %v), Hugging Face's hash %s", i, g.BulkTexts[i], ids, got, err, want)
				}
			}
			if failed > 0 {
				t.Errorf("%d mismatches with Hugging Face tokenizers %s (%d of %d bulk texts)", failed, g.Version, bulkFailed, len(g.BulkTexts))
			}
		})
	}
}

func checkDecode(report func(string, ...any), tk *Tokenizer, what string, ids []int, want, wantSkip *string) {
	if want != nil {
		if got, err := tk.Decode(ids, false); err != nil || got != *want {
			report("%s: Decode = %q, %v; want %q", what, got, err, *want)
		}
	}
	if wantSkip != nil {
		if got, err := tk.Decode(ids, true); err != nil || got != *wantSkip {
			report("%s: Decode(skip special) = %q, %v; want %q", what, got, err, *wantSkip)
		}
	}
}
