// Package llm runs a twell model's forward pass on an NVIDIA GPU: the same
// computation as model.Model.Forward (Llama decoder layers with RMSNorm,
// RoPE including its scaling variants, causal attention with grouped-query
// heads over a KV cache, ReLU- or SiLU-gated MLPs, tied or separate LM
// head), in bf16 storage with fp32 arithmetic.
//
// An Engine uploads a model's weights once. Each Forward call appends tokens
// to a batch of sequences of any lengths (prefill and decode are the same
// call) and returns logits:
//
//   - the KV cache is in pages of 64 positions by default (kvcache.go): a
//     sequence holds the pages its length needs, taken from the engine's
//     pool as tokens are appended and given back by Truncate and Free, so
//     the Engine implements engine.Paged and a server admits requests by
//     the pages they use; the kernels find a position's page through the
//     sequence's page table, once per block of 64 keys;
//   - the residual stream is fp32; embedding gather and RMSNorm fused with
//     the residual add (norm.cu), and RoPE fused with the KV-cache write
//     (rope.cu) are kernels compiled by NVRTC on first use (for decode
//     passes RoPE and the cache write are fused into the q/k/v projection
//     itself, proj.cu); each .cu file has a Go launcher beside it (norm.go,
//     rope.go, proj.go, attention.go) that names the kernel's arguments;
//   - the QKV, output and LM-head projections are cuBLASLt GEMMs (the QKV
//     weights fused into one matrix; logits in fp32), except that passes of
//     at most 4 tokens (decode steps) run the QKV and output projections
//     through the engine's gemv_rows kernel;
//   - attention is flash-attention 2 style (online softmax over blocks of
//     64 keys streamed through a cp.async pipeline, one CTA per sequence,
//     head and block of 128 queries, sequence by sequence and each
//     sequence's longest first), on tensor cores: on
//     Hopper wgmma (attn_wgmma.cu, 3 stages) for prefill passes with
//     head_dim 64, else mma.sync and ldmatrix (attn.cu) for head_dim 64 and
//     128; a plain kernel otherwise;
//   - each MLP is a gpu.MLP (the TwELL sparse path or cuBLASLt dense, chosen
//     by measured density) where the gate is ReLU and the shape suits the
//     TwELL kernels, and a gpu.DenseMLP (cuBLASLt, the same dense code as
//     gpu.MLP's dense path, ReLU or SiLU) otherwise.
//
// Results agree with the float32 CPU model within bf16 rounding; the tests
// check logits, decoding against recomputation, batching, and caches in
// pages against caches of one page each.
package llm
