"""Make a tiny Llama checkpoint with Hugging Face transformers and the logits twell must match.

Usage: python3 scripts/hf-crosscheck-model.py OUT_DIR
Writes OUT_DIR/<name>/ (config.json + model.safetensors, saved by LlamaForCausalLM) and
OUT_DIR/<name>/expected.json (token ids, float32 logits of every position, greedy continuation
and, per greedy step, the margin between PyTorch's top two logits).
Then: TWELL_HF_DIR=OUT_DIR go test ./cpu/llm -run TestHFCrossCheck (CPU) and
TWELL_HF_DIR=OUT_DIR go test ./gpu/llm -run TestHFCrossCheckGPU (GPU), or the compiled test binaries.
"""
import json, os, sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

out = sys.argv[1]
torch.manual_seed(1234)
cases = {
    # GQA, untied, ReLU gate: the twell sparse model family.
    "relu-gqa": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=160, hidden_act="relu", tie_word_embeddings=False),
    # Tied embeddings, head_dim != hidden/heads, llama3 RoPE scaling.
    "relu-tied-llama3": dict(hidden_size=64, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=16, vocab_size=97, hidden_act="relu",
                             tie_word_embeddings=True,
                             rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=32)),
    # A dense SiLU model runs on twell's dense path.
    "silu": dict(hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=50, hidden_act="silu", tie_word_embeddings=False),
}
for name, kw in cases.items():
    cfg = LlamaConfig(max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                      bos_token_id=1, eos_token_id=2, **kw)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # larger weights than the 0.02 init, so every layer matters
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    d = os.path.join(out, name)
    model.save_pretrained(d, safe_serialization=True)
    ids = torch.randint(3, cfg.vocab_size, (1, 12))
    with torch.no_grad():
        logits = model(ids).logits[0]
        gen = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    margins = [float(v[0] - v[1]) for v in (s[0].topk(2).values for s in gen.scores)]
    json.dump({"ids": ids[0].tolist(), "logits": logits.tolist(), "greedy": gen.sequences[0, ids.shape[1]:].tolist(),
               "greedy_margin": margins},
              open(os.path.join(d, "expected.json"), "w"))
    print(name, "written", tuple(logits.shape))
