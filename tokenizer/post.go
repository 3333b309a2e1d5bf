package tokenizer

// A postProcessor adds the special tokens of a template to the ids of one sequence (when the
// caller asks for special tokens).
type postProcessor interface {
	process(ids []int) []int
	// ends returns the special ids the processor puts before and after the sequence.
	ends() (before, after []int)
}

// postTemplate is TemplateProcessing's "single" template: special tokens around $A.
type postTemplate struct {
	before, after []int
}

func (p postTemplate) process(ids []int) []int {
	if len(p.before) == 0 && len(p.after) == 0 {
		return ids
	}
	out := make([]int, 0, len(p.before)+len(ids)+len(p.after))
	out = append(out, p.before...)
	out = append(out, ids...)
	return append(out, p.after...)
}

func (p postTemplate) ends() (before, after []int) { return p.before, p.after }

// postSequence runs processors one after the other.
type postSequence []postProcessor

func (s postSequence) process(ids []int) []int {
	for _, p := range s {
		ids = p.process(ids)
	}
	return ids
}

func (s postSequence) ends() (before, after []int) {
	for _, p := range s {
		b, a := p.ends()
		before = append(append([]int(nil), b...), before...)
		after = append(after, a...)
	}
	return before, after
}
