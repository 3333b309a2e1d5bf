package data

// HeldOutDoc is one document of a source's validation split, as Build writes it.
type HeldOutDoc struct {
	// Source is the name of the source that holds the document.
	Source string
	// Name says where the document is in the input: its file path, "file:line" for a line
	// of a JSONL file, or "source[i]" for the i-th of Source.Docs.
	Name string
	// Text is the document as Build tokenizes it (normalized, see Normalize). For a source
	// with a single document it is the held-out end of that document (Part is set).
	Text string
	// Part reports that Text is only the end of the document, cut at a paragraph break
	// because the document is its source's only one (see BuildConfig.ValFrac).
	Part bool
}

// HeldOut returns the documents that Build, given these sources and this validation
// fraction, holds out for validation, in the order Build writes them (sources in order, then
// documents in input order): the same normalization, deduplication across sources and
// choice of the last ceil(valFrac*n) kept documents of each source, with a single-document
// source cut in two. Tokenized with Build's encoder, each text gives the tokens of its
// source's validation shards (the encoding plus the end-of-text token). valFrac 0 holds out
// nothing. Every document is read twice, as in Build.
func HeldOut(sources []Source, valFrac float64) ([]HeldOutDoc, error) {
	p, err := newSplitPlan(BuildConfig{Sources: sources, ValFrac: valFrac})
	if err != nil {
		return nil, err
	}
	if err := p.scan(); err != nil {
		return nil, err
	}
	var out []HeldOutDoc
	err = p.eachPart(func(d docPart) error {
		if d.val {
			out = append(out, HeldOutDoc{Source: p.sources[d.src].src.Name, Name: d.loc, Text: d.text, Part: d.cut})
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}
