"""Cross-check twell's safetensors files and config.json with Python safetensors/transformers.

Usage: python3 hf_compat.py GO_WRITTEN_DIR OUT_DIR
  GO_WRITTEN_DIR: written by `TWELL_HF_COMPAT_DIR=... go test ./model -run TestWriteHFCompatFiles`
  OUT_DIR: receives files written by Python, for
           `TWELL_PY_COMPAT_DIR=OUT_DIR go test ./safetensors -run TestReadPythonWritten`
"""
import json, os, sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

src, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)

# 1. Go-written file: every tensor loads (mmap views need aligned offsets), roundings match torch.
p = f"{src}/single/model.safetensors"
with safe_open(p, framework="pt") as f:
    assert f.metadata() == {"format": "pt", "source": "twell"}, f.metadata()
    t = {k: f.get_tensor(k) for k in f.keys()}
ref = t["F32"]
assert torch.equal(t["BF16"], ref.to(torch.bfloat16)), "bf16 rounding differs from torch"
assert torch.equal(t["F16"], ref.to(torch.float16)), "f16 rounding differs from torch"
assert torch.equal(t["F64"], ref.to(torch.float64))
assert t["u8"].tolist() == [1, 2, 255] and t["i32"].tolist() == [1, -2]
assert t["scalar_i64"].shape == () and t["scalar_i64"].item() == 7
assert load_file(p).keys() == t.keys()
print("go-written single file: OK")

# 2. Go-written config.json and checkpoints load in transformers with no missing/extra keys.
from transformers import LlamaConfig, LlamaForCausalLM

cfg = LlamaConfig.from_pretrained(f"{src}/tiny")
assert cfg.hidden_act == "relu" and cfg.tie_word_embeddings and cfg.num_key_value_heads == 2, cfg
logits = {}
for sub in ["tiny", "tiny_sharded"]:
    m, info = LlamaForCausalLM.from_pretrained(f"{src}/{sub}", output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    assert not bad, (sub, bad)
    w = m.model.layers[1].mlp.up_proj.weight
    files = [x for x in os.listdir(f"{src}/{sub}") if x.endswith(".safetensors")]
    raw = {}
    for x in files:
        raw.update(load_file(f"{src}/{sub}/{x}"))
    assert torch.equal(w.to(torch.bfloat16), raw["model.layers.1.mlp.up_proj.weight"])
    with torch.no_grad():
        logits[sub] = m(torch.tensor([[1, 5, 9, 3]])).logits.float()
    print(f"transformers loads {sub} ({len(files)} file(s)): OK")
assert torch.allclose(logits["tiny"], logits["tiny"])

# 3. Python-written files for the Go reader.
g = torch.Generator().manual_seed(1)
x = torch.randn(5, 7, generator=g) * 3
tensors = {
    "f32": x, "bf16": x.to(torch.bfloat16), "f16": x.to(torch.float16), "f64": x.double(),
    "i64": torch.arange(-3, 3, dtype=torch.int64), "u8": torch.arange(250, 256, dtype=torch.uint8),
    "bool": torch.tensor([True, False, True]), "i32": torch.tensor([[7, -8]], dtype=torch.int32),
    "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
}
save_file(tensors, f"{out}/py.safetensors", metadata={"format": "pt", "k": "v"})
expect = {k: {"dtype": str(v.dtype), "shape": list(v.shape), "hex": v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex() if v.numel() else "",
              "f32": v.float().flatten().tolist() if v.is_floating_point() else None}
          for k, v in tensors.items()}
with open(f"{out}/py.json", "w") as fh:
    json.dump(expect, fh)
LlamaForCausalLM(cfg).save_pretrained(f"{out}/hf_sharded", max_shard_size="250KB")
print("python-written files:", sorted(os.listdir(out)), sorted(os.listdir(f"{out}/hf_sharded")))
