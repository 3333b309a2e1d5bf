#!/usr/bin/env python3
"""Check that Hugging Face `tokenizers` loads a tokenizer.json and gives the ids twell expects.

Usage:

    python3 scripts/check-tokenizer-hf.py TOKENIZER_JSON EXPECTED_JSON

EXPECTED_JSON is written by `twell tokenizer train -expect FILE` (or by hand):

    {"vocab_size": 8192,                          # optional: get_vocab_size(with_added_tokens=True)
     "special": {"<|endoftext|>": 8191},          # optional: token_to_id of special tokens
     "cases": [{"text": "Hello world", "ids": [...]}, ...]}

For every case it checks encode(text).ids == ids (HF's default add_special_tokens=True) and
decode(ids, skip_special_tokens=False) == text. It prints a summary, the first mismatches,
and exits 0 when everything matches, 1 otherwise (2 on bad usage).
"""
import json
import sys


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        from tokenizers import Tokenizer, __version__ as tk_version
    except ImportError:
        print("check-tokenizer-hf: the Python package `tokenizers` is not installed", file=sys.stderr)
        return 2
    tok_path, exp_path = argv[1], argv[2]
    tok = Tokenizer.from_file(tok_path)
    with open(exp_path, encoding="utf-8") as f:
        exp = json.load(f)

    problems = []
    if "vocab_size" in exp:
        got = tok.get_vocab_size(with_added_tokens=True)
        if got != exp["vocab_size"]:
            problems.append(f"vocab size: HF {got}, expected {exp['vocab_size']}")
    for content, want in exp.get("special", {}).items():
        got = tok.token_to_id(content)
        if got != want:
            problems.append(f"special token {content!r}: HF id {got}, expected {want}")

    cases = exp["cases"]
    id_mismatch = decode_mismatch = 0
    for i, case in enumerate(cases):
        text, want = case["text"], case["ids"]
        got = tok.encode(text).ids
        if got != want:
            id_mismatch += 1
            if id_mismatch <= 5:
                first = next((k for k in range(min(len(got), len(want))) if got[k] != want[k]), min(len(got), len(want)))
                problems.append(
                    f"case {i} {text[:60]!r}: ids differ at position {first}: "
                    f"HF {got[max(0, first - 3):first + 5]} vs expected {want[max(0, first - 3):first + 5]} "
                    f"(lengths {len(got)} and {len(want)})"
                )
        back = tok.decode(want, skip_special_tokens=False)
        if back != text:
            decode_mismatch += 1
            if decode_mismatch <= 5:
                problems.append(f"case {i}: decode(expected ids) = {back[:60]!r}, text {text[:60]!r}")

    print(
        f"tokenizers {tk_version}: {tok_path}: {len(cases)} cases, "
        f"{len(cases) - id_mismatch} ids equal, {len(cases) - decode_mismatch} decodes equal"
    )
    for p in problems:
        print("  MISMATCH " + p)
    if problems:
        print("FAIL")
        return 1
    print("OK: Hugging Face tokenizers gives the expected ids")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
