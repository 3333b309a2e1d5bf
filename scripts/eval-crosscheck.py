#!/usr/bin/env python3
"""Recompute with PyTorch the log-likelihoods that `twell eval -items` wrote, and compare.

Usage:

    python3 scripts/eval-crosscheck.py CHECKPOINT ITEMS.jsonl [--device auto|cuda|cpu]
        [--tolerance 1e-3] [--batch 8] [--json SUMMARY.json] [--reference torch|python]

CHECKPOINT is the twell checkpoint folder the items file was made from (config.json in Hugging
Face LlamaConfig form and model.safetensors); ITEMS.jsonl is what `twell eval -items` wrote
(schema twell.eval-items/1). The model is built as transformers' LlamaForCausalLM in float32
(eager attention, no TF32), with the MLP gate activation twell applied (the run row's
hidden_act) and, for twell's up/down-only MLPs (mlp_gated false), an MLP act(x Wu^T) Wd^T.
Every task item's choices are rescored from the exact context and continuation token ids in
the file, and every perplexity window from its token ids, each sequence starting at
position 0; log-probabilities are a float64 log-softmax of the float32 logits, as in twell.

It reports, per kind of row, the largest and the mean absolute difference of a token's
log-probability between twell and PyTorch, the largest difference of a choice's (or window's)
summed log-likelihood divided by its token count, and per task the accuracies both sides give.
It exits 0 when no token's log-probability differs by more than --tolerance nats, 1 when one
does (or PyTorch gives a non-finite value), 2 on bad usage or input or missing packages. The
table comes last on stdout; --json writes the same as a summary (schema
twell.eval-crosscheck/1). Needs PyTorch, transformers and safetensors; it makes no network
request. The items file is checked before they are imported.

--reference python replaces PyTorch by a float64 forward pass written in plain Python (no
packages needed; plain RoPE only): thousands of times slower, for checkpoints of a few million
parameters and short items files, where PyTorch is not installed.

twell's sparse MLP path (TwELL, `twell eval -mlp sparse`, and `auto` where a model is sparse
enough) holds the gate activations in bf16, so only `-mlp dense` on the CPU is float32
throughout; the run row's "mlp" and "device" say which ran, and a note says what to expect.
"""
import argparse
import json
import math
import os
import sys

ITEMS_SCHEMA = "twell.eval-items/1"
SUMMARY_SCHEMA = "twell.eval-crosscheck/1"
PROG = "eval-crosscheck"


class InputError(Exception):
    """Bad input: the message says where."""


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="eval-crosscheck.py",
        description="Recompute with PyTorch (transformers' LlamaForCausalLM, float32) the per-token "
        "log-likelihoods `twell eval -items` wrote and compare them.",
        epilog="Exit status: 0 all tokens within the tolerance, 1 some token outside it, 2 bad usage, "
        "bad input or missing packages.")
    p.add_argument("checkpoint", help="twell checkpoint folder (config.json, model.safetensors)")
    p.add_argument("items", help="JSON lines from `twell eval -items` (schema %s)" % ITEMS_SCHEMA)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="where PyTorch runs (auto: cuda when available)")
    p.add_argument("--tolerance", type=float, default=1e-3,
                   help="largest allowed absolute difference of one token's log-probability, in nats "
                   "(default 1e-3)")
    p.add_argument("--batch", type=int, default=8, help="sequences per forward pass (default 8)")
    p.add_argument("--json", metavar="FILE", help="also write a JSON summary to FILE")
    p.add_argument("--reference", choices=["torch", "python"], default="torch",
                   help="what recomputes the log-probabilities: torch (transformers' LlamaForCausalLM, "
                   "float32) or python (a plain-Python float64 forward pass, for tiny checkpoints; "
                   "--device and --batch do not apply)")
    a = p.parse_args(argv)
    if not (a.tolerance > 0 and math.isfinite(a.tolerance)):
        p.error("--tolerance %r: want a positive number" % a.tolerance)
    if a.batch < 1:
        p.error("--batch %d: want >= 1" % a.batch)
    if not os.path.isdir(a.checkpoint):
        p.error("checkpoint %s: not a folder" % a.checkpoint)
    if not os.path.isfile(os.path.join(a.checkpoint, "config.json")):
        p.error("checkpoint %s: no config.json" % a.checkpoint)
    if not os.path.isfile(a.items):
        p.error("items file %s: not found" % a.items)
    if a.json and not os.path.isdir(os.path.dirname(os.path.abspath(a.json))):
        p.error("--json %s: its folder does not exist" % a.json)
    return a


# ---- reading and checking the items file (no PyTorch needed) ----

def _ints(v, what, where):
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise InputError("%s: %s: want a list of integers" % (where, what))
    return v


def _floats(v, what, where):
    if not isinstance(v, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        raise InputError("%s: %s: want a list of numbers" % (where, what))
    return [float(x) for x in v]


def _field(row, key, where):
    if key not in row:
        raise InputError("%s: field %r is missing" % (where, key))
    return row[key]


def read_items(path):
    """Returns the run row, the window rows and the item rows of an items file, checked."""
    run, windows, items = None, [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            where = "%s line %d" % (path, n)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise InputError("%s: not JSON: %s" % (where, e))
            if not isinstance(row, dict):
                raise InputError("%s: not a JSON object" % where)
            if row.get("schema") != ITEMS_SCHEMA:
                raise InputError("%s: schema %r, want %r (a file from `twell eval -items`)" % (where, row.get("schema"), ITEMS_SCHEMA))
            kind = row.get("kind")
            if run is None and kind != "run":
                raise InputError("%s: the first row has kind %r, want \"run\"" % (where, kind))
            if kind == "run":
                if run is not None:
                    raise InputError("%s: a second run row" % where)
                for k in ("context", "hidden_act", "mlp_gated", "vocab_size", "windows", "items", "device", "mlp"):
                    _field(row, k, where)
                run = row
            elif kind == "window":
                windows.append(check_window(row, run, where))
            elif kind == "item":
                items.append(check_item(row, run, where))
            else:
                raise InputError("%s: unknown kind %r" % (where, kind))
    if run is None:
        raise InputError("%s: empty (want a run row, then window and item rows)" % path)
    if len(windows) != run["windows"] or len(items) != run["items"]:
        raise InputError("%s: %d window and %d item rows, but the run row announces %d and %d (a cut file?)"
                         % (path, len(windows), len(items), run["windows"], run["items"]))
    if not windows and not items:
        raise InputError("%s: no window or item rows: nothing to compare" % path)
    return run, windows, items


def _check_ids(ids, vocab, what, where):
    for t in ids:
        if not 0 <= t < vocab:
            raise InputError("%s: %s: token id %d outside the vocabulary of %d" % (where, what, t, vocab))


def check_window(row, run, where):
    where = "%s (window %s of %r)" % (where, row.get("window"), row.get("source"))
    start, end, score = (_field(row, k, where) for k in ("start", "end", "score"))
    tokens = _ints(_field(row, "tokens", where), "tokens", where)
    lps = _floats(_field(row, "token_logprobs", where), "token_logprobs", where)
    if not (isinstance(start, int) and isinstance(end, int) and isinstance(score, int)
            and 0 <= start < score <= end and len(tokens) == end - start and len(lps) == end - score):
        raise InputError("%s: start %r, score %r, end %r with %d tokens and %d log-probabilities do not fit together"
                         % (where, start, score, end, len(tokens), len(lps)))
    _check_ids(tokens, run["vocab_size"], "tokens", where)
    return dict(source=str(row.get("source")), window=row.get("window"), tokens=tokens,
                positions=list(range(score - 1 - start, end - 1 - start)), targets=tokens[score - start:],
                logprobs=lps, total=-float(_field(row, "nll", where)), where=where)


def check_item(row, run, where):
    where = "%s (%s line %s)" % (where, row.get("task"), row.get("line"))
    ctx = _ints(_field(row, "context", where), "context", where)
    conts = _field(row, "continuations", where)
    lps = _field(row, "token_logprobs", where)
    loglik = _floats(_field(row, "loglik", where), "loglik", where)
    chars = _ints(_field(row, "chars", where), "chars", where)
    gold = _field(row, "gold", where)
    if not isinstance(conts, list) or not conts or not isinstance(lps, list) or len(lps) != len(conts) \
            or len(loglik) != len(conts) or len(chars) != len(conts):
        raise InputError("%s: continuations, token_logprobs, loglik and chars want one entry per choice" % where)
    if not isinstance(gold, int) or not 0 <= gold < len(conts):
        raise InputError("%s: gold %r is not a choice" % (where, gold))
    if not ctx:
        raise InputError("%s: empty context (twell always scores from at least one token)" % where)
    _check_ids(ctx, run["vocab_size"], "context", where)
    choices = []
    for j, c in enumerate(conts):
        c = _ints(c, "continuation %d" % j, where)
        lp = _floats(lps[j], "token_logprobs %d" % j, where)
        if not c or len(lp) != len(c):
            raise InputError("%s: choice %d: %d tokens and %d log-probabilities" % (where, j, len(c), len(lp)))
        if chars[j] < 1:
            raise InputError("%s: choice %d: chars %d" % (where, j, chars[j]))
        _check_ids(c, run["vocab_size"], "continuation %d" % j, where)
        choices.append(dict(tokens=ctx + c[:-1], positions=list(range(len(ctx) - 1, len(ctx) - 1 + len(c))),
                            targets=c, logprobs=lp, total=loglik[j], where="%s choice %d" % (where, j)))
    return dict(task=str(row.get("task")), line=row.get("line"), gold=gold, chars=chars,
                pred=row.get("pred"), pred_norm=row.get("pred_norm"), choices=choices, where=where)


# ---- the PyTorch side ----

def import_torch():
    """Imports PyTorch, transformers and safetensors, or exits 2 saying which is missing."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    mods = {}
    for name in ("torch", "transformers", "safetensors"):
        try:
            mods[name] = __import__(name)
        except ImportError as e:
            print("%s: this script needs PyTorch, transformers and safetensors; importing %s failed: %s"
                  % (PROG, name, e), file=sys.stderr)
            sys.exit(2)
    return mods["torch"], mods["transformers"]


def load_state(torch, ckpt):
    """Reads the checkpoint's tensors (model.safetensors or a sharded index) as float32."""
    from safetensors.torch import load_file
    single = os.path.join(ckpt, "model.safetensors")
    index = os.path.join(ckpt, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        with open(index) as f:
            files = sorted({os.path.join(ckpt, v) for v in json.load(f)["weight_map"].values()})
    else:
        raise InputError("checkpoint %s: no model.safetensors (or model.safetensors.index.json)" % ckpt)
    state = {}
    for p in files:
        for k, v in load_file(p).items():
            state[k] = v.to(torch.float32)
    return state


def load_model(torch, transformers, ckpt, run, device):
    """LlamaForCausalLM in float32 on device with the checkpoint's weights and twell's MLP."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.activations import ACT2FN

    cfg = LlamaConfig.from_pretrained(ckpt, local_files_only=True, attn_implementation="eager")
    if getattr(cfg, "model_type", "llama") != "llama":
        raise InputError("checkpoint %s: model_type %r, want \"llama\"" % (ckpt, cfg.model_type))
    if cfg.vocab_size != run["vocab_size"]:
        raise InputError("checkpoint %s has a vocabulary of %d but the items file was made with %d (another checkpoint?)"
                         % (ckpt, cfg.vocab_size, run["vocab_size"]))
    notes = []
    act = run["hidden_act"]
    if act not in ACT2FN:
        raise InputError("the items file's hidden_act %r is not an activation transformers knows" % act)
    if cfg.hidden_act != act:
        notes.append("hidden_act %r in config.json; using %r, the activation twell applied" % (cfg.hidden_act, act))
        cfg.hidden_act = act
    for attr in ("mlp_bias", "attention_bias"):
        if getattr(cfg, attr, False):
            raise InputError("checkpoint %s: %s is true, which twell does not run" % (ckpt, attr))
    try:
        cfg.dtype = torch.float32
    except Exception:  # older transformers: torch_dtype
        cfg.torch_dtype = torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model = model.float()
    if not run["mlp_gated"]:
        h, f = cfg.hidden_size, cfg.intermediate_size

        class UpDownMLP(torch.nn.Module):
            """twell's up/down-only MLP: down(act(up(x)))."""

            def __init__(self):
                super().__init__()
                self.up_proj = torch.nn.Linear(h, f, bias=False, device=device)
                self.down_proj = torch.nn.Linear(f, h, bias=False, device=device)
                self.act_fn = ACT2FN[act]

            def forward(self, x):
                return self.down_proj(self.act_fn(self.up_proj(x)))

        for layer in model.model.layers:
            layer.mlp = UpDownMLP()
        notes.append("mlp_gated false: each MLP is down(act(up(x)))")
    state = load_state(torch, ckpt)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    if tied:
        state.pop("lm_head.weight", None)  # twell ignores a stored copy of a tied head
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise InputError("checkpoint %s: tensors missing %s, unexpected %s" % (ckpt, missing[:5], unexpected[:5]))
    if tied and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        model.lm_head.weight = model.model.embed_tokens.weight
    model.to(device).eval()
    return model, cfg, notes


def score(torch, model, seqs, device, batch, progress):
    """Per sequence (dicts with tokens, positions, targets), the float64 log-probability of each target."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]["tokens"]))
    out = [None] * len(seqs)
    for lo in range(0, len(order), batch):
        idx = order[lo:lo + batch]
        width = max(len(seqs[i]["tokens"]) for i in idx)
        # Right padding: causal attention keeps the padding out of every real position.
        x = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            x[r, :len(seqs[i]["tokens"])] = torch.tensor(seqs[i]["tokens"], dtype=torch.long)
        with torch.no_grad():
            logits = model(input_ids=x.to(device), use_cache=False).logits
        for r, i in enumerate(idx):
            s = seqs[i]
            rows = logits[r, torch.tensor(s["positions"], device=logits.device)].to(torch.float64)
            lp = torch.log_softmax(rows, dim=-1)
            tgt = torch.tensor(s["targets"], device=logits.device).unsqueeze(1)
            out[i] = lp.gather(1, tgt).squeeze(1).tolist()
        del logits
        progress(min(lo + batch, len(order)), len(order))
    return out


# ---- the plain-Python reference (float64, no packages) ----

def read_safetensors(path):
    """The tensors of a safetensors file as flat lists of floats, with their shapes."""
    import array
    import struct
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise InputError("%s: not a safetensors file" % path)
    n = struct.unpack("<Q", raw[:8])[0]
    try:
        header = json.loads(raw[8:8 + n])
    except ValueError as e:
        raise InputError("%s: bad safetensors header: %s" % (path, e))
    base, out = 8 + n, {}
    for name, v in header.items():
        if name == "__metadata__":
            continue
        a, b = v["data_offsets"]
        buf = raw[base + a:base + b]
        if v["dtype"] == "F32":
            vals = array.array("f")
            vals.frombytes(buf)
        elif v["dtype"] == "BF16":
            half = array.array("H")
            half.frombytes(buf)
            wide = array.array("I", (h << 16 for h in half))
            vals = array.array("f")
            vals.frombytes(wide.tobytes())
        elif v["dtype"] == "F16":
            vals = struct.unpack("<%de" % (len(buf) // 2), buf)
        else:
            raise InputError("%s: tensor %s has dtype %s (want F32, BF16 or F16)" % (path, name, v["dtype"]))
        if sys.byteorder != "little" and isinstance(vals, array.array):
            vals.byteswap()
        out[name] = (list(vals), v["shape"])
    return out


class PlainLlama:
    """A Llama forward pass in plain Python floats (float64), as transformers computes it."""

    def __init__(self, ckpt, run):
        with open(os.path.join(ckpt, "config.json")) as f:
            c = json.load(f)
        if c.get("model_type", "llama") != "llama":
            raise InputError("checkpoint %s: model_type %r, want \"llama\"" % (ckpt, c.get("model_type")))
        rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise InputError("checkpoint %s: RoPE scaling %r; --reference python does plain RoPE only" % (ckpt, rope))
        self.H = c.get("hidden_size", 4096)
        self.nh = c.get("num_attention_heads", 32)
        self.nkv = c.get("num_key_value_heads") or self.nh
        self.hd = c.get("head_dim") or self.H // self.nh
        self.L = c.get("num_hidden_layers", 32)
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.V = c.get("vocab_size", 32000)
        self.maxpos = c.get("max_position_embeddings", 2048)
        theta = c.get("rope_theta") or rope.get("rope_theta") or 10000.0
        if self.V != run["vocab_size"]:
            raise InputError("checkpoint %s has a vocabulary of %d but the items file was made with %d (another checkpoint?)"
                             % (ckpt, self.V, run["vocab_size"]))
        act = run["hidden_act"]
        if act == "relu":
            self.act = lambda x: x if x > 0 else 0.0
        elif act == "silu":
            self.act = lambda x: x / (1.0 + math.exp(-x)) if x > -700 else 0.0
        else:
            raise InputError("hidden_act %r: --reference python knows relu and silu" % act)
        self.gated = run["mlp_gated"]
        path = os.path.join(ckpt, "model.safetensors")
        if not os.path.isfile(path):
            raise InputError("checkpoint %s: no model.safetensors" % ckpt)
        t = read_safetensors(path)

        def mat(name, rows, cols):
            if name not in t:
                raise InputError("checkpoint %s: tensor %s is missing" % (ckpt, name))
            vals, shape = t[name]
            if shape != [rows, cols]:
                raise InputError("checkpoint %s: %s has shape %s, want %s" % (ckpt, name, shape, [rows, cols]))
            return [vals[i * cols:(i + 1) * cols] for i in range(rows)]

        def vec(name):
            vals, shape = t.get(name, (None, None))
            if shape != [self.H]:
                raise InputError("checkpoint %s: %s is missing or not of shape [%d]" % (ckpt, name, self.H))
            return vals

        H, F, hd = self.H, c.get("intermediate_size", 11008), self.hd
        self.embed = mat("model.embed_tokens.weight", self.V, H)
        tied = c.get("tie_word_embeddings", False)
        self.head = self.embed if tied else mat("lm_head.weight", self.V, H)
        self.norm = vec("model.norm.weight")
        self.layers = []
        for i in range(self.L):
            p = "model.layers.%d." % i
            self.layers.append(dict(
                n1=vec(p + "input_layernorm.weight"), n2=vec(p + "post_attention_layernorm.weight"),
                q=mat(p + "self_attn.q_proj.weight", self.nh * hd, H), k=mat(p + "self_attn.k_proj.weight", self.nkv * hd, H),
                v=mat(p + "self_attn.v_proj.weight", self.nkv * hd, H), o=mat(p + "self_attn.o_proj.weight", H, self.nh * hd),
                g=mat(p + "mlp.gate_proj.weight", F, H) if self.gated else None,
                u=mat(p + "mlp.up_proj.weight", F, H), d=mat(p + "mlp.down_proj.weight", H, F)))
        self.inv = [1.0 / theta ** (2 * i / hd) for i in range(hd // 2)]

    @staticmethod
    def mv(m, x):
        return [sum(a * b for a, b in zip(r, x)) for r in m]

    def rms(self, x, w):
        s = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + self.eps)
        return [v * s * g for v, g in zip(x, w)]

    def rope(self, v, pos, heads):
        hd, h, out = self.hd, self.hd // 2, []
        cs = [(math.cos(pos * f), math.sin(pos * f)) for f in self.inv]
        for k in range(heads):
            x = v[k * hd:(k + 1) * hd]
            out += [x[i] * cs[i][0] - x[i + h] * cs[i][1] for i in range(h)]
            out += [x[i + h] * cs[i][0] + x[i] * cs[i][1] for i in range(h)]
        return out

    def logprobs(self, tokens, positions, targets):
        hd, group = self.hd, self.nh // self.nkv
        xs = [list(self.embed[t]) for t in tokens]
        for ly in self.layers:
            qs, ks, vs = [], [], []
            for p, x in enumerate(xs):
                h = self.rms(x, ly["n1"])
                qs.append(self.rope(self.mv(ly["q"], h), p, self.nh))
                ks.append(self.rope(self.mv(ly["k"], h), p, self.nkv))
                vs.append(self.mv(ly["v"], h))
            for p in range(len(xs)):
                att = []
                for k in range(self.nh):
                    kv = (k // group) * hd
                    q = qs[p][k * hd:(k + 1) * hd]
                    sc = [sum(a * b for a, b in zip(q, ks[u][kv:kv + hd])) / math.sqrt(hd) for u in range(p + 1)]
                    m = max(sc)
                    e = [math.exp(v - m) for v in sc]
                    z = sum(e)
                    att += [sum(e[u] * vs[u][kv + d] for u in range(p + 1)) / z for d in range(hd)]
                xs[p] = [a + b for a, b in zip(xs[p], self.mv(ly["o"], att))]
            for p, x in enumerate(xs):
                h = self.rms(x, ly["n2"])
                up = self.mv(ly["u"], h)
                a = [self.act(g) * u for g, u in zip(self.mv(ly["g"], h), up)] if self.gated else [self.act(u) for u in up]
                xs[p] = [v + w for v, w in zip(x, self.mv(ly["d"], a))]
        out = []
        for pos, tgt in zip(positions, targets):
            lg = self.mv(self.head, self.rms(xs[pos], self.norm))
            m = max(lg)
            out.append(lg[tgt] - m - math.log(sum(math.exp(v - m) for v in lg)))
        return out


def score_plain(model, seqs, progress):
    out = []
    for i, s in enumerate(seqs):
        out.append(model.logprobs(s["tokens"], s["positions"], s["targets"]))
        progress(i + 1, len(seqs))
    return out


# ---- comparison ----

def compare(seqs, got):
    """Statistics of |twell - torch| per token and per sequence (sum divided by tokens)."""
    st = dict(rows=len(seqs), tokens=0, max_token=0.0, sum_token=0.0, max_per_token_sum=0.0,
              worst=None, worst_sum=None, nonfinite=0)
    for s, lps in zip(seqs, got):
        total = 0.0
        for k, (a, b) in enumerate(zip(s["logprobs"], lps)):
            total += b
            st["tokens"] += 1
            if not math.isfinite(b):
                st["nonfinite"] += 1
                d = math.inf
            else:
                d = abs(a - b)
                st["sum_token"] += d
            if st["worst"] is None or d > st["max_token"]:
                st["max_token"] = d
                st["worst"] = dict(where=s["where"], token=k, target=s["targets"][k], twell=a, reference=b)
        s["ref_total"] = total
        d = abs(s["total"] - total) / len(s["targets"]) if math.isfinite(total) else math.inf
        if st["worst_sum"] is None or d > st["max_per_token_sum"]:
            st["max_per_token_sum"] = d
            st["worst_sum"] = dict(where=s["where"], tokens=len(s["targets"]), twell=s["total"], reference=total)
    finite = st["tokens"] - st["nonfinite"]
    st["mean_token"] = st["sum_token"] / finite if finite else math.inf
    del st["sum_token"]
    return st


def finite_or_null(v):
    """v with every non-finite float replaced by None, so that the JSON is standard."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: finite_or_null(x) for k, x in v.items()}
    if isinstance(v, list):
        return [finite_or_null(x) for x in v]
    return v


def argmax(vals):
    best = 0
    for j, v in enumerate(vals):
        if v > vals[best]:
            best = j
    return best


def task_accuracies(items):
    """Per task: acc and acc_norm from twell's and from the reference's log-likelihoods, and how many items differ."""
    tasks = {}
    for it in items:
        t = tasks.setdefault(it["task"], dict(items=0, acc_twell=0, acc_reference=0, acc_norm_twell=0,
                                              acc_norm_reference=0, pred_differs=0, pred_norm_differs=0))
        tw = [c["total"] for c in it["choices"]]
        pt = [c["ref_total"] for c in it["choices"]]
        ch = it["chars"]
        p_tw, p_pt = argmax(tw), argmax(pt)
        n_tw = argmax([v / c for v, c in zip(tw, ch)])
        n_pt = argmax([v / c for v, c in zip(pt, ch)])
        t["items"] += 1
        t["acc_twell"] += p_tw == it["gold"]
        t["acc_reference"] += p_pt == it["gold"]
        t["acc_norm_twell"] += n_tw == it["gold"]
        t["acc_norm_reference"] += n_pt == it["gold"]
        t["pred_differs"] += p_tw != p_pt
        t["pred_norm_differs"] += n_tw != n_pt
    for t in tasks.values():
        for k in ("acc_twell", "acc_reference", "acc_norm_twell", "acc_norm_reference"):
            t[k] /= t["items"]
    return tasks


def table(stats, tol, ok):
    lines = ["%-8s %7s %9s %14s %14s %16s" % ("rows", "count", "tokens", "max |d|/token", "mean |d|/token", "max |d sum|/tok")]
    for name, st in stats.items():
        lines.append("%-8s %7d %9d %14.3e %14.3e %16.3e" % (name, st["rows"], st["tokens"], st["max_token"],
                                                            st["mean_token"], st["max_per_token_sum"]))
    lines.append("%s: largest per-token difference %.3e nats, tolerance %.0e"
                 % ("PASS" if ok else "FAIL", max(st["max_token"] for st in stats.values()), tol))
    return "\n".join(lines)


def main(argv):
    args = parse_args(argv)
    try:
        run, windows, items = read_items(args.items)
    except (InputError, OSError, UnicodeDecodeError) as e:
        print("%s: %s" % (PROG, e), file=sys.stderr)
        return 2
    if run["device"] != "cpu":
        print("%s: note: twell ran on %r; its GPU engine computes in bf16, so expect differences well above "
              "float32's (run `twell eval -device cpu -mlp dense` for the float32 comparison)" % (PROG, run["device"]),
              file=sys.stderr)
    elif run["mlp"] != "dense":
        print("%s: note: twell ran with -mlp %s; its sparse MLP path holds the gate activations in bf16, so expect "
              "differences above float32's where it ran (`twell eval -device cpu -mlp dense` is float32 throughout)"
              % (PROG, run["mlp"]), file=sys.stderr)
    if args.reference == "python":
        versions = dict(reference="python", python_version=sys.version.split()[0])
        device = "python"
        try:
            model = PlainLlama(args.checkpoint, run)
        except (InputError, OSError, ValueError, KeyError) as e:
            print("%s: loading %s: %s" % (PROG, args.checkpoint, e), file=sys.stderr)
            return 2
        maxpos = model.maxpos

        def scorer(seqs, prog):
            return score_plain(model, seqs, prog)
    else:
        torch, transformers = import_torch()
        versions = dict(reference="torch", torch_version=torch.__version__, transformers_version=transformers.__version__)
        device = args.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            print("%s: --device cuda, but PyTorch sees no CUDA device" % PROG, file=sys.stderr)
            return 2
        # Full float32 matrix products: no TF32.
        try:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            torch.set_float32_matmul_precision("highest")
        except (AttributeError, RuntimeError) as e:
            print("%s: note: could not turn TF32 off: %s" % (PROG, e), file=sys.stderr)
        try:
            model, cfg, notes = load_model(torch, transformers, args.checkpoint, run, device)
        except (InputError, OSError, ValueError, RuntimeError) as e:
            print("%s: loading %s: %s" % (PROG, args.checkpoint, e), file=sys.stderr)
            return 2
        for n in notes:
            print("%s: %s" % (PROG, n), file=sys.stderr)
        maxpos = cfg.max_position_embeddings

        def scorer(seqs, prog):
            return score(torch, model, seqs, device, args.batch, prog)
    longest = max([len(w["tokens"]) for w in windows] + [len(c["tokens"]) for it in items for c in it["choices"]])
    if longest > maxpos:
        print("%s: a sequence of %d tokens is longer than the model's %d positions" % (PROG, longest, maxpos),
              file=sys.stderr)
        return 2

    step = args.batch if args.reference == "torch" else 1

    def progress(what):
        def f(done, total):
            if done == total or done % (50 * step) < step:
                print("%s: %s %d/%d" % (PROG, what, done, total), file=sys.stderr)
        return f

    stats = {}
    choices = [c for it in items for c in it["choices"]]
    if windows:
        stats["windows"] = compare(windows, scorer(windows, progress("windows")))
    if choices:
        stats["choices"] = compare(choices, scorer(choices, progress("choices")))
    ok = all(st["max_token"] <= args.tolerance and st["nonfinite"] == 0 for st in stats.values())
    tasks = task_accuracies(items)

    for name, st in stats.items():
        w = st["worst"]
        print("worst %s token: %s, token %d (id %d): twell %.9f, %s %.9f"
              % (name, w["where"], w["token"], w["target"], w["twell"], args.reference, w["reference"]))
    for name, t in tasks.items():
        print("task %s: %d items; acc twell %.4f %s %.4f; acc_norm twell %.4f %s %.4f; "
              "%d and %d items pick another choice" % (name, t["items"], t["acc_twell"], args.reference, t["acc_reference"],
                                                       t["acc_norm_twell"], args.reference, t["acc_norm_reference"],
                                                       t["pred_differs"], t["pred_norm_differs"]))
    if args.json:
        summary = dict(schema=SUMMARY_SCHEMA, checkpoint=args.checkpoint, items=args.items, twell_run=run,
                       device=device, dtype="float32" if args.reference == "torch" else "float64",
                       tolerance=args.tolerance, passed=ok, rows=stats, tasks=tasks, **versions)
        with open(args.json, "w") as f:
            json.dump(finite_or_null(summary), f, indent=2, allow_nan=False)
            f.write("\n")
    print()
    print(table(stats, args.tolerance, ok))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
