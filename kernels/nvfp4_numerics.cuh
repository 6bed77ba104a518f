// Bit-exact numerics of docs/format.md section 4, shared by every kernel.
//
// Self-contained (no CUDA headers) so NVRTC needs no include path. Every floating-point
// operation is an explicit round-to-nearest intrinsic (flush-to-zero only where docs/format.md says so,
// in inline PTX): the bytes must not depend on compiler contraction or fast-math flags.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define NVFP4_FULL_MASK 0xffffffffu

// The kernel cache's proof of identity (jit.py passes the full key): the loader finds this string
// in a cubin's bytes before it runs the file, so a kernel saved under another key's name is refused.
extern "C" __device__ const char nvfp4_mla_key[] = NVFP4_MLA_KEY;

// bf16(x): round to nearest even, NaN -> 0x7FC0 (torch's conversion).
__device__ __forceinline__ u32 bf16_bits(float x) {
    const u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7FC0u;
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ float bf16_value(u32 bits16) { return __uint_as_float(bits16 << 16); }

// GPT-J RoPE of one pair: one rounded product, one fused multiply-add.
__device__ __forceinline__ u32 rope_pair_bits(u32 pair, float c, float s) {
    const float xe = bf16_value(pair & 0xffffu), xo = bf16_value(pair >> 16);
    const float even = __fmaf_rn(xe, c, -__fmul_rn(xo, s));
    const float odd = __fmaf_rn(xe, s, __fmul_rn(xo, c));
    return bf16_bits(even) | (bf16_bits(odd) << 16);
}

// Rotates the 4 pairs of a 16-byte chunk of RoPE dims with their cos and sin.
__device__ __forceinline__ uint4 rope_chunk(uint4 x, float4 c, float4 s) {
    return make_uint4(rope_pair_bits(x.x, c.x, s.x), rope_pair_bits(x.y, c.y, s.y),
                      rope_pair_bits(x.z, c.z, s.z), rope_pair_bits(x.w, c.w, s.w));
}

// E4M3 (fn) code of x >= 0 or NaN: nearest even, saturating at 448 (0x7E), NaN -> 0x7F.
__device__ __forceinline__ u32 e4m3_code(float x) {
    if (!(x <= 448.0f)) return x != x ? 0x7Fu : 0x7Eu;
    if (x < 0.015625f) return (u32)__float2int_rn(x * 512.0f);  // subnormal binade: m * 2^-9 (exact scaling)
    const u32 u = __float_as_uint(x);
    const u32 mant3 = (u >> 20) & 7u, rest = u & 0xfffffu;  // 3 kept mantissa bits, 20 rounded off
    const u32 up = rest > 0x80000u || (rest == 0x80000u && (mant3 & 1u));
    return (((u >> 23) - 120u) << 3) + mant3 + up;  // exponent bias 127 -> 7; a carry bumps the exponent
}

__device__ __forceinline__ float e4m3_value(u32 code) {
    if (code == 0x7Fu) return __uint_as_float(0x7fffffffu);
    const u32 e = code >> 3, m = code & 7u;
    return e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : __fmul_rn((float)m, 0.001953125f);
}

// E2M1 code: sign of y (also when the magnitude rounds to 0), magnitude to nearest even on
// {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at 6; NaN -> +6 (0x7). Integer arithmetic on the fp32
// bits: in [1, 6] the format's one mantissa bit is fp32 bit 22 (round to nearest even there and
// rebias the exponent); below 1 the spacing is 0.5, so 2|y| is rounded to an integer by adding
// 1.5 * 2^23, whose sum keeps that integer in its low bits.
__device__ __forceinline__ u32 e2m1_code(float y) {
    const float a = fminf(fabsf(y), 6.0f);
    const u32 u = __float_as_uint(a);
    const u32 high = (u + 0x1FFFFFu + ((u >> 22) & 1u) - 0x3F000000u) >> 22;
    const u32 low = __float_as_uint(__fmaf_rn(a, 2.0f, 12582912.0f)) & 3u;
    const u32 code = (a < 1.0f ? low : high) | ((__float_as_uint(y) >> 28) & 8u);
    return y != y ? 7u : code;
}

// Flush-to-zero multiply (sign-preserving, inputs and result), as the reference quantizer's
// fast-math product: a subnormal v times an infinite inverse scale is 0 * inf = NaN.
__device__ __forceinline__ float mul_ftz(float a, float b) {
    float r;
    asm("mul.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// |v| with a subnormal v flushed to +0.
__device__ __forceinline__ float abs_ftz(float v) {
    float r;
    asm("abs.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
    return r;
}

// a > b ? a : b -- the reference quantizer's max: a NaN in b survives, a NaN in a does not.
__device__ __forceinline__ float sel(float a, float b) { return a > b ? a : b; }

// Steps 2-4 for one half (8 consecutive NoPE values, 16 bytes) of a 16-element group: the
// half's amax after the reference quantizer's two-thread reduction. The partner half must be in
// lane ^ 1 of the same warp, and every lane of the warp must call this (it shuffles).
__device__ __forceinline__ float half_amax(uint4 x) {
    const u32 w[4] = {x.x, x.y, x.z, x.w};
    float mx = 0.0f, my = 0.0f;  // per-lane folds: x = even elements, y = odd
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float ax = abs_ftz(bf16_value(w[i] & 0xffffu)), ay = abs_ftz(bf16_value(w[i] >> 16));
        mx = i ? sel(mx, ax) : ax;
        my = i ? sel(my, ay) : ay;
    }
    const float px = __shfl_xor_sync(NVFP4_FULL_MASK, mx, 1), py = __shfl_xor_sync(NVFP4_FULL_MASK, my, 1);
    return sel(sel(px, mx), sel(py, my));
}

__device__ __forceinline__ u32 scale_code(float amax) { return e4m3_code(__fmul_rn(amax, __uint_as_float(0x3E2AAAABu))); }

// Steps 5-7: the 8 E2M1 codes of a half (element k in bits 4k..4k+3).
__device__ __forceinline__ u32 half_codes(uint4 x, float amax, u32 code) {
    const u32 w[4] = {x.x, x.y, x.z, x.w};
    const float inv = amax != 0.0f ? __frcp_rn(e4m3_value(code)) : 0.0f;
    u32 codes = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const float v = bf16_value((w[k >> 1] >> ((k & 1) * 16)) & 0xffffu);
        codes |= e2m1_code(mul_ftz(v, inv)) << (4 * k);
    }
    return codes;
}

// ---------------------------------------------------------------- decoding (reading records back)
//
// Every decode is exact, so no rounding rule applies: an E2M1 value has at most 2 significant
// bits and an E4M3 value at most 4, so their product has at most 6 and is 0 or of magnitude in
// [2^-10, 2688], normal in both BF16 and fp32. Signs follow IEEE: the sign of a product is the
// XOR of its factors' signs, zeros included (E2M1 code 8 is -0: -0 x +s = -0, -0 x -s = +0).
// NaN: a NaN scale byte makes its whole group canonical NaN (fp32 0x7FC00000, BF16 0x7FC0).

// E4M3 (fn) byte as fp32: bit 7 is the sign, so 0x80..0xFE are the negatives of 0x00..0x7E (0x80
// is -0); 0x7F and 0xFF are NaN (see e4m3_byte_is_nan; the NaN returned here is not canonical).
__device__ __forceinline__ float e4m3_signed_value(u32 byte) {
    return __uint_as_float(__float_as_uint(e4m3_value(byte & 0x7Fu)) | ((byte & 0x80u) << 24));
}

__device__ __forceinline__ bool e4m3_byte_is_nan(u32 byte) { return (byte & 0x7Fu) == 0x7Fu; }

// The BF16 bits of each E2M1 magnitude 0, .5, 1, 1.5, 2, 3, 4, 6 (0x0000 0x3F00 0x3F80 0x3FC0 0x4000
// 0x4040 0x4080 0x40C0), as 8-byte tables of their low and high bytes (byte m = magnitude code m).
#define E2M1_BF16_LOW_0_3 0xC0800000u
#define E2M1_BF16_LOW_4_7 0xC0804000u
#define E2M1_BF16_HIGH_0_3 0x3F3F3F00u
#define E2M1_BF16_HIGH_4_7 0x40404040u

// The 4 E2M1 codes in bits 0..15 of `codes` (element k in bits 4k..4k+3: bit 3 the sign, bits
// 0..2 the magnitude) as 2 words of BF16 pairs, element 2j in the low half of word j. Exact, signs
// kept (code 8 is -0.0). Two byte-permute table look-ups, then the pairs are interleaved and the
// code's sign bits moved to bits 15 and 31.
__device__ __forceinline__ uint2 e2m1x4_bf16x2(u32 codes) {
    const u32 magnitude = codes & 0x7777u;  // one byte-permute selector per element
    const u32 low = __byte_perm(E2M1_BF16_LOW_0_3, E2M1_BF16_LOW_4_7, magnitude);
    const u32 high = __byte_perm(E2M1_BF16_HIGH_0_3, E2M1_BF16_HIGH_4_7, magnitude);
    // The sign of element 2j is bit 7 of byte j of (codes << 4), that of element 2j+1 bit 7 of byte j of codes.
    const u32 shifted = codes << 4;
    const u32 sign01 = __byte_perm(shifted, codes, 0x4000u), sign23 = __byte_perm(shifted, codes, 0x5111u);
    return make_uint2(__byte_perm(low, high, 0x5140u) | (sign01 & 0x80008000u),
                      __byte_perm(low, high, 0x7362u) | (sign23 & 0x80008000u));
}

// The 8 E2M1 codes of a word (element k in bits 4k..4k+3) as 4 words of BF16 pairs (exact).
__device__ __forceinline__ uint4 e2m1x8_bf16x2(u32 codes) {
    const uint2 a = e2m1x4_bf16x2(codes), b = e2m1x4_bf16x2(codes >> 16);
    return make_uint4(a.x, a.y, b.x, b.y);
}

// a * b on each BF16 half, for factors whose products are exact (as above: nothing is rounded).
// sm_80 has no bf16x2 multiply: an fma with a -0 addend, which keeps a zero product's sign.
__device__ __forceinline__ u32 bf16x2_mul_exact(u32 a, u32 b) {
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
    return r;
}

// Each BF16 half that is NaN (any sign or payload) becomes the canonical 0x7FC0; others unchanged.
__device__ __forceinline__ u32 bf16x2_canonical(u32 pair) {
    const u32 low = (pair & 0x7FFFu) > 0x7F80u ? 0x7FC0u : pair & 0xFFFFu;
    const u32 high = (pair >> 16 & 0x7FFFu) > 0x7F80u ? 0x7FC0u : pair >> 16;
    return low | high << 16;
}

// 8 consecutive NoPE values of one group (their codes as in e2m1x8_bf16x2, the group's scale
// byte) as canonical BF16 pairs: e2m1 x e4m3, exact.
__device__ __forceinline__ uint4 nvfp4_bf16x8(u32 codes, u32 scale_byte) {
    if (e4m3_byte_is_nan(scale_byte)) return make_uint4(0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u);
    const u32 s = __float_as_uint(e4m3_signed_value(scale_byte)) >> 16;  // BF16 holds every E4M3 value
    const u32 scale = s | s << 16;
    const uint4 v = e2m1x8_bf16x2(codes);
    return make_uint4(bf16x2_mul_exact(v.x, scale), bf16x2_mul_exact(v.y, scale), bf16x2_mul_exact(v.z, scale),
                      bf16x2_mul_exact(v.w, scale));
}

// 4 consecutive NoPE values of one group (codes in bits 0..15, as in e2m1x4_bf16x2) as the bits of
// canonical fp32 values: e2m1 x e4m3, exact.
__device__ __forceinline__ uint4 nvfp4_f32x4(u32 codes, u32 scale_byte) {
    if (e4m3_byte_is_nan(scale_byte)) return make_uint4(0x7FC00000u, 0x7FC00000u, 0x7FC00000u, 0x7FC00000u);
    const float scale = e4m3_signed_value(scale_byte);
    const uint2 v = e2m1x4_bf16x2(codes);
    return make_uint4(__float_as_uint(__fmul_rn(bf16_value(v.x & 0xFFFFu), scale)),
                      __float_as_uint(__fmul_rn(bf16_value(v.x >> 16), scale)),
                      __float_as_uint(__fmul_rn(bf16_value(v.y & 0xFFFFu), scale)),
                      __float_as_uint(__fmul_rn(bf16_value(v.y >> 16), scale)));
}

// ---------------------------------------------------------------- asynchronous copies (sm_80+)

// Starts a 16-byte global -> shared copy (cp.async, cached in L2 only); both addresses 16-byte aligned.
__device__ __forceinline__ void cp_async16(void* shared_dst, const void* global_src) {
    const u32 dst = static_cast<u32>(__cvta_generic_to_shared(shared_dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(global_src) : "memory");
}

// Starts a 4- or 8-byte global -> shared copy (cp.async, cached in L1 and L2); both addresses aligned to it.
template <int BYTES>
__device__ __forceinline__ void cp_async_small(void* shared_dst, const void* global_src) {
    static_assert(BYTES == 4 || BYTES == 8, "cp.async.ca copies 4, 8 or 16 bytes");
    const u32 dst = static_cast<u32>(__cvta_generic_to_shared(shared_dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(dst), "l"(global_src), "n"(BYTES) : "memory");
}

// Waits for this thread's cp.async copies; other threads see them after a barrier (__syncwarp).
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
