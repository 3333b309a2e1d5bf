// rope.cuh: the rotation of rotary position embedding that rope_kv,
// attn_wg64's query load (prefill with Engine.AttnRope) and attn_dec's
// (decode with Engine.DecRope) apply, written out once so that all give the
// same bits.
#pragma once

// rope_rotate rotates the pair (a, b), elements i and i + hd/2 of a head
// (Hugging Face's rotate_half), by the angle of cosine c and sine s:
//   ra = a c - b s,  rb = b c + a s,
// each as one fused multiply-add on a rounded product, spelled with
// intrinsics so that no kernel contracts it differently.
__device__ __forceinline__ void rope_rotate(float a, float b, float c, float s, float& ra, float& rb) {
  ra = __fmaf_rn(a, c, -__fmul_rn(b, s));
  rb = __fmaf_rn(b, c, __fmul_rn(a, s));
}

// rope_rotate8 rotates 8 pairs: the bf16 elements of A (8 consecutive of a
// head's first half) with those of B (the same columns of its second
// half), by the cosines c[0..8) and sines s[0..8) of their columns (fp32,
// 16-byte aligned); A and B become the rotated values, rounded to bf16.
__device__ __forceinline__ void rope_rotate8(uint4& A, uint4& B, const float* c, const float* s) {
  const float4 c0 = *(const float4*)c, c1 = *(const float4*)(c + 4);
  const float4 s0 = *(const float4*)s, s1 = *(const float4*)(s + 4);
  u32 a[4] = {A.x, A.y, A.z, A.w}, b[4] = {B.x, B.y, B.z, B.w};
  float cc[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
  float ss[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
  u32 ra[4], rb[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float x0, y0, x1, y1;
    rope_rotate(bf_lo(a[i]), bf_lo(b[i]), cc[2 * i], ss[2 * i], x0, y0);
    rope_rotate(bf_hi(a[i]), bf_hi(b[i]), cc[2 * i + 1], ss[2 * i + 1], x1, y1);
    ra[i] = pack_bf2(x0, x1);
    rb[i] = pack_bf2(y0, y1);
  }
  A = make_uint4(ra[0], ra[1], ra[2], ra[3]);
  B = make_uint4(rb[0], rb[1], rb[2], rb[3]);
}
