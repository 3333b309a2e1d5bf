// Package tokenizer reads Hugging Face tokenizer.json files and turns text into token ids and
// back, with the same ids as the Hugging Face tokenizers library.
//
// It covers the BPE tokenizers that decoder-only language models use:
//
//   - byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): a pre-tokenizer regex splits the text into
//     words, every byte is mapped to a printable character, and BPE merges run per word;
//   - SentencePiece-style BPE (Llama 2, Mistral): spaces become "▁", BPE runs on the whole
//     text, and characters missing from the vocabulary fall back to byte tokens <0xNN>.
//
// The pipeline is the one of Hugging Face tokenizers: added tokens (special tokens such as
// "<s>" or "<|endoftext|>") are cut out of the text first, the rest is normalized,
// pre-tokenized and tokenized by the model, and the post-processor adds the special tokens of
// the template (for example Llama 2's leading <s>). Decoding maps ids back to token strings
// and runs the decoder chain.
//
// A component type that this package does not implement makes Parse fail with an error that
// names the type and its JSON path; nothing is silently approximated. A Tokenizer is safe for
// concurrent use.
package tokenizer
