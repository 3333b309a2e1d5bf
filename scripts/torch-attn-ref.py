"""Yardsticks for the GPU engine, run on the GPU machine: PyTorch SDPA (flash,
memory-efficient and cuDNN backends) on the sparselm-1.5b attention shape
(B x 32 heads x 2048 x 64, causal, bf16) and cuBLAS GEMMs of the q/k/v and
output projections at 131072 tokens. CUDA-event medians of 20 after a
warm-up. Output: docs/bench/raw/2026-12-02-h200-torch-attn-gemm.txt."""
import torch, time, torch.nn.functional as F
torch.manual_seed(0)
def t(fn, reps=20):
    fn(); torch.cuda.synchronize()
    ts=[]
    for _ in range(reps):
        a=torch.cuda.Event(enable_timing=True); b=torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts)//2]
for B in (16,64):
    q=torch.randn(B,32,2048,64,device='cuda',dtype=torch.bfloat16)
    k=torch.randn_like(q); v=torch.randn_like(q)
    for be in ("flash","efficient","cudnn"):
        try:
            from torch.nn.attention import sdpa_kernel, SDPBackend
            bk={"flash":SDPBackend.FLASH_ATTENTION,"efficient":SDPBackend.EFFICIENT_ATTENTION,"cudnn":SDPBackend.CUDNN_ATTENTION}[be]
            with sdpa_kernel(bk):
                ms=t(lambda: F.scaled_dot_product_attention(q,k,v,is_causal=True))
            fl=4*B*32*2048*2048*64/2
            print(f"sdpa {be} B={B} causal: {ms:.3f} ms, {fl/ms/1e9:.0f} TFLOP/s")
        except Exception as e: print(be, "failed", e)
x=torch.randn(131072,2048,device='cuda',dtype=torch.bfloat16)
for n in (6144,2048):
    w=torch.randn(n,2048,device='cuda',dtype=torch.bfloat16)
    ms=t(lambda: x@w.t()); print(f"gemm 131072x{n}x2048: {ms:.3f} ms {2*131072*n*2048/ms/1e9:.0f} TFLOP/s")
