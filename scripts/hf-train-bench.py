#!/usr/bin/env python3
"""Time a PyTorch + Hugging Face transformers dense training step.

The baseline for `twell bench train -step`: LlamaForCausalLM of the
SparseLM-1.5B shape (hidden 2048, MLP 5632 with a ReLU gate, 28 layers, 32
heads of 64, vocabulary 49152, tied embeddings), random weights, with the
strongest plain settings: bf16 weights and autocast-free bf16 compute, SDPA
attention, fused AdamW on fp32 master weights, the loss computed by the model
(its own shift and cross-entropy). One step = forward, backward, gradient
clipping to 1.0, AdamW, zero_grad. Wall-clock around each step with the device
synchronised; two warm-up steps, median of -steps.

usage: hf-train-bench.py [-layers 28] [-batch 8] [-len 2048] [-steps 5] [-json FILE]
"""
import argparse
import json
import statistics
import sys
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-layers", type=int, default=28)
    ap.add_argument("-batch", type=int, default=8)
    ap.add_argument("-len", type=int, default=2048)
    ap.add_argument("-steps", type=int, default=5)
    ap.add_argument("-seed", type=int, default=1)
    ap.add_argument("-json")
    a = ap.parse_args()
    if min(a.layers, a.batch, a.len, a.steps) < 1:
        sys.exit("hf-train-bench: -layers, -batch, -len and -steps must be positive")

    torch.manual_seed(a.seed)
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=a.layers, num_attention_heads=32,
                      num_key_value_heads=32, head_dim=64, vocab_size=49152, max_position_embeddings=max(2048, a.len),
                      rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="relu", tie_word_embeddings=True,
                      attn_implementation="sdpa")
    # fp32 master weights, bf16 compute: the mixed-precision recipe twell's
    # trainer follows (fp32 weights and AdamW state, bf16 GEMM inputs).
    model = LlamaForCausalLM(cfg).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.len + 1), generator=g).cuda()
    inp, labels = ids[:, :-1].contiguous(), ids[:, :-1].contiguous()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=inp, labels=labels, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    ms = statistics.median(times)
    tokens = a.batch * a.len
    res = {
        "engine": f"pytorch {torch.__version__} + transformers {transformers.__version__} (sdpa, bf16 autocast, fp32 master, fused AdamW)",
        "device": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d"),
        "params": sum(p.numel() for p in model.parameters()),
        "layers": a.layers,
        "batch": a.batch,
        "seq": a.len,
        "step_ms": ms,
        "tokens_per_ms": tokens / ms,
        "times_ms": times,
        "loss": float(loss),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    print(f"hf train step {a.batch} x {a.len}, {a.layers} layers: {ms:.1f} ms, {res['tokens_per_ms']:.1f} tokens/ms "
          f"(steps {', '.join(f'{t:.1f}' for t in times)}), peak {res['peak_gib']:.1f} GiB", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
