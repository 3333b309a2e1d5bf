#!/usr/bin/env python3
"""Time PyTorch + Hugging Face transformers prefill on a twell checkpoint.

The baseline for `twell bench model -device cuda`: the same weights (written by
`twell bench model -save DIR`), LlamaForCausalLM in bf16 with SDPA attention,
one forward pass over BATCH random sequences of LEN tokens, logits of the last
token only and no KV cache (the strongest settings for plain prefill). CUDA
events around each pass; one warm-up, median of REPS.

usage: hf-prefill-bench.py DIR [-batch 64] [-len 2048] [-reps 3] [-json FILE]
"""
import argparse
import json
import statistics
import sys
import time

import torch
import transformers
from transformers import LlamaForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("-batch", type=int, default=64)
    ap.add_argument("-len", type=int, default=2048)
    ap.add_argument("-reps", type=int, default=3)
    ap.add_argument("-seed", type=int, default=1)
    ap.add_argument("-json")
    a = ap.parse_args()

    model = LlamaForCausalLM.from_pretrained(a.dir, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model = model.cuda().eval()
    cfg = model.config
    g = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.len), generator=g).cuda()

    def run():
        with torch.inference_mode():
            try:
                out = model(input_ids=ids, use_cache=False, logits_to_keep=1)
            except TypeError:  # transformers < 4.50
                out = model(input_ids=ids, use_cache=False, num_logits_to_keep=1)
        return out.logits

    run()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(a.reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        run()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    ms = statistics.median(times)
    res = {
        "engine": f"pytorch {torch.__version__} + transformers {transformers.__version__} (sdpa, bf16)",
        "device": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d"),
        "model_dir": a.dir,
        "layers": cfg.num_hidden_layers,
        "prefill_tokens": a.batch * a.len,
        "prefill_ms": ms,
        "prefill_tokens_per_ms": a.batch * a.len / ms,
        "times_ms": times,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    print(f"hf prefill {a.batch} x {a.len}: {ms:.1f} ms, {res['prefill_tokens_per_ms']:.1f} tokens/ms "
          f"(reps {', '.join(f'{t:.1f}' for t in times)}), peak {res['peak_gib']:.1f} GiB", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
