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
typedef unsigned long long u64;

#define NVFP4_FULL_MASK 0xffffffffu

// The kernel cache's proof of identity (jit.py passes the full key): the loader finds this string
// in a cubin's bytes before it runs the file, so a kernel saved under another key's name is refused.
extern "C" __device__ const char nvfp4_mla_key[] = NVFP4_MLA_KEY;

__device__ __forceinline__ float bf16_value(u32 bits16) { return __uint_as_float(bits16 << 16); }

// bf16(lo) | bf16(hi) << 16 in one conversion (cvt.rn.bf16x2.f32, sm_80+: nearest even, no flush,
// overflow to inf); a NaN becomes 0x7FFF, not torch's 0x7FC0 (for values that cannot be NaN).
__device__ __forceinline__ u32 bf16x2_rn(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// A bf16x2_rn pair with torch's NaN: each NaN half (cvt gives 0x7FFF or 0xFFFF) becomes 0x7FC0.
// Branch-free: a half is NaN when its low 15 bits pass 0x7F80 (adding 0x7F sets its bit 15).
__device__ __forceinline__ u32 torch_nan_halves(u32 pair) {
    const u32 nan = ((pair & 0x7FFF7FFFu) + 0x007F007Fu) & 0x80008000u;
    const u32 mask = nan | (nan - (nan >> 15));  // 0xFFFF in each NaN half
    return (pair & ~mask) | (0x7FC07FC0u & mask);
}

// bf16(lo) | bf16(hi) << 16 as torch converts: nearest even, every NaN 0x7FC0.
__device__ __forceinline__ u32 bf16x2_bits(float lo, float hi) { return torch_nan_halves(bf16x2_rn(lo, hi)); }

// GPT-J RoPE of one pair: one rounded product, one fused multiply-add.
__device__ __forceinline__ u32 rope_pair_bits(u32 pair, float c, float s) {
    const float xe = bf16_value(pair & 0xffffu), xo = bf16_value(pair >> 16);
    const float even = __fmaf_rn(xe, c, -__fmul_rn(xo, s));
    const float odd = __fmaf_rn(xe, s, __fmul_rn(xo, c));
    return bf16x2_bits(even, odd);
}

// Rotates the 4 pairs of a 16-byte chunk of RoPE dims with their cos and sin.
__device__ __forceinline__ uint4 rope_chunk(uint4 x, float4 c, float4 s) {
    return make_uint4(rope_pair_bits(x.x, c.x, s.x), rope_pair_bits(x.y, c.y, s.y), rope_pair_bits(x.z, c.z, s.z),
                      rope_pair_bits(x.w, c.w, s.w));
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

// ---------------------------------------------------------------- exact scalar quantizer
//
// Steps 2-7 in fp32, one element at a time: the definition the fast path below must match, and
// the path it takes for the rare inputs it does not handle (NaN, zero or subnormal scales).

// Steps 2-3 for one half (8 consecutive NoPE values, 16 bytes) of a 16-element group: the
// per-lane folds (x: even elements, y: odd), in the reference quantizer's order.
__device__ __forceinline__ float2 exact_lane_maxima(uint4 x) {
    const u32 w[4] = {x.x, x.y, x.z, x.w};
    float mx = 0.0f, my = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float ax = abs_ftz(bf16_value(w[i] & 0xffffu)), ay = abs_ftz(bf16_value(w[i] >> 16));
        mx = i ? sel(mx, ax) : ax;
        my = i ? sel(my, ay) : ay;
    }
    return make_float2(mx, my);
}

// Steps 2-4 for a whole group (halves h0, h1): each half's amax after the reference quantizer's
// two-thread reduction, where each half folds its partner's lane maxima into its own.
__device__ __forceinline__ float2 exact_group_amax(uint4 h0, uint4 h1) {
    const float2 m0 = exact_lane_maxima(h0), m1 = exact_lane_maxima(h1);
    return make_float2(sel(sel(m1.x, m0.x), sel(m1.y, m0.y)), sel(sel(m0.x, m1.x), sel(m0.y, m1.y)));
}

// Steps 5-7: the 8 E2M1 codes of a half (element k in bits 4k..4k+3).
__device__ __forceinline__ u32 exact_half_codes(uint4 x, float amax, u32 code) {
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

// ---------------------------------------------------------------- the quantizer's fast path
//
// Two BF16 values a 32-bit word throughout. Without NaN the reduction order of steps 2-3 does
// not matter: the amax is the maximum of the magnitudes, flushed afterwards. Step 7's code of a
// value v is the number of thresholds T1 < ... < T7 its magnitude reaches, where Tk is the
// smallest BF16 magnitude whose scaled product rounds to E2M1 boundary k or above (0.25, 0.75,
// 1.25, 1.75, 2.5, 3.5, 5, ties as in step 7): packed BF16 subtractions, no product formed.
//
// The KV loop is bound by the ALU pipe (logic, permutes, integer adds and compares: half the
// rate of the FMA pipe, which runs the BF16 arithmetic), so the fast path spends BF16
// subtractions to save logic: seven a pair of values rather than a selection of three, and the
// magnitudes as operand modifiers (|v|) rather than masks.
//
// The thresholds, for a scale d = 2^e (1 + m/8) (every nonzero E4M3 value has this form; m is
// its fp32 mantissa's top 3 bits): Bk * d is exact in BF16 (at most 3 + 4 significant bits), and
// a BF16 magnitude other than Bk * d is at least 2^-9 relative away from it, so its product with
// inv = rcp(d) (relative error < 2^-24) lands on the same side of Bk as the exact quotient.
// Only |v| = Bk * d needs the rounded product, fl(Bk * d * inv), which depends on m alone. So
// Tk = bits(d) + delta_k(m): bits(Bk * d) - bits(d), plus 1 where that rounded product stays
// below the code's upper side. 2.5, 3.5 and 5 are 1.25, 1.75, 1.25 doubled: T5 = T3 + 128,
// T6 = T4 + 128, T7 = T3 + 256 (one binade is 128 BF16 steps). delta_1 is -255 for every m;
// delta_2..4 are the bases below plus the byte of m in the tables (t(m) bytes 0..3 in LO, 4..7
// in HI), checked against the reference by tests/test_gpu_quantizer_exhaustive.py.
#define E2M1_DELTA1 (-255)
#define E2M1_DELTA2 (-64)
#define E2M1_DELTA2_LO 0x14100800u
#define E2M1_DELTA2_HI 0x04080C10u
#define E2M1_DELTA3 33
#define E2M1_DELTA3_LO 0x0C080400u
#define E2M1_DELTA3_HI 0x050C1210u
#define E2M1_DELTA4 96
#define E2M1_DELTA4_LO 0x0A0C0C00u
#define E2M1_DELTA4_HI 0x02040608u

// Byte permute (prmt.b32): a selector nibble with bit 3 set replicates the sign bit of the chosen
// byte (__byte_perm documents 3-bit selectors only).
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 selector) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
    return r;
}

// Per-half maximum of two BF16 pairs; a NaN in either operand gives NaN (0x7FFF).
__device__ __forceinline__ u32 bf16x2_max_nan(u32 a, u32 b) {
    u32 r;
    asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// |a| + b on each BF16 half, as fma(|a|, 1, b): for the threshold tests the sign of the rounded
// result is the sign of the exact one, and a difference of zero is +0. The abs is one instruction
// per pair of values, shared by its seven tests (an FMA-pipe |a| on sm_90, not a mask).
__device__ __forceinline__ u32 bf16x2_abs_add(u32 a, u32 b) {
    u32 r;
    asm("{\n\t.reg .b32 m;\n\tabs.bf16x2 m, %1;\n\tfma.rn.bf16x2 %0, m, %2, %3;\n\t}"
        : "=r"(r)
        : "r"(a), "r"(0x3F803F80u), "r"(b));
    return r;
}

// Per-lane maxima of a half's magnitudes (lane x, the even values, in the low half), NaN if any
// is; the sign bits are not cleared (callers mask them). sm_86+ folds the abs into the maximum
// (max.xorsign.abs: the sign is the XOR of the operands'), with no masking instruction.
__device__ __forceinline__ u32 half_magnitude_max(uint4 x) {
#if __CUDA_ARCH__ >= 860
    u32 r;
    asm("{\n\t.reg .b32 a, b;\n\tmax.NaN.xorsign.abs.bf16x2 a, %1, %2;\n\tmax.NaN.xorsign.abs.bf16x2 b, %3, %4;\n\t"
        "max.NaN.xorsign.abs.bf16x2 %0, a, b;\n\t}"
        : "=r"(r)
        : "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w));
    return r;
#else
    constexpr u32 m = 0x7fff7fffu;
    return bf16x2_max_nan(bf16x2_max_nan(x.x & m, x.y & m), bf16x2_max_nan(x.z & m, x.w & m));
#endif
}

// The maximum of two results of half_magnitude_max (or of this), in the same form.
__device__ __forceinline__ u32 magnitude_max(u32 a, u32 b) {
#if __CUDA_ARCH__ >= 860
    u32 r;
    asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
#else
    return bf16x2_max_nan(a, b);  // both nonnegative already
#endif
}

// The fp32 bits of the value of E4M3 code 0..0x7E.
__device__ __forceinline__ u32 e4m3_value_bits(u32 code) {
#if __CUDA_ARCH__ >= 890
    u32 r;
    asm("{\n\t.reg .b16 c, h;\n\t.reg .f16 lo, hi;\n\t"
        "cvt.u16.u32 c, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, c;\n\tmov.b32 {lo, hi}, %0;\n\t"
        "cvt.f32.f16 %0, lo;\n\t}"
        : "=r"(r)
        : "r"(code));
    return r;
#else
    return __float_as_uint(e4m3_value(code));
#endif
}

// Steps 2-4 for a whole group (halves h0, h1 of one thread): the amax of each half (x: half 0,
// y: half 1), and whether the group holds a NaN. Without NaN both are the group's magnitude
// maximum, flushed; a group with a NaN takes the exact fold, whose order then matters,
// and the exact scalar codes (group_codes).
struct GroupAmax {
    float2 amax;
    bool nan;
};

__device__ __forceinline__ GroupAmax group_amax(uint4 h0, uint4 h1) {
    const u32 lanes = magnitude_max(half_magnitude_max(h0), half_magnitude_max(h1));
    const float amax = __uint_as_float(magnitude_max(lanes, prmt(lanes, lanes, 0x1032u)) & 0x7fff0000u);
    if (amax != amax) return {exact_group_amax(h0, h1), true};
    const float flushed = abs_ftz(amax);  // a subnormal amax counts as zero
    return {make_float2(flushed, flushed), false};
}

// Step 4: E4M3 code of amax * R6 (nearest even, saturating at 448, NaN -> 0x7F).
__device__ __forceinline__ u32 scale_code(float amax) {
    const float sf = __fmul_rn(amax, __uint_as_float(0x3E2AAAABu));
#if __CUDA_ARCH__ >= 890
    u32 r;  // min.NaN first: the conversion's saturation is only documented for finite inputs
    asm("{\n\t.reg .f32 s, z;\n\t.reg .b16 c;\n\tmov.f32 z, 0f00000000;\n\t"
        "min.NaN.f32 s, %1, 0f43E00000;\n\tcvt.rn.satfinite.e4m3x2.f32 c, z, s;\n\tcvt.u32.u16 %0, c;\n\t}"
        : "=r"(r)
        : "f"(sf));
    return r;
#else
    return e4m3_code(sf);
#endif
}

// The 7 thresholds of E4M3 code 1..0x7E as negative BF16 pairs (-Tk in both halves).
struct E2M1Thresholds {
    u32 neg[7];
};

__device__ __forceinline__ E2M1Thresholds e2m1_thresholds(u32 code) {
    const u32 d = e4m3_value_bits(code);
    const u32 bits = prmt(d, d, 0x3232u);                    // BF16 bits of d in both halves
    const u32 table = ((d >> 20) & 7u) * 0x0101u + 0x8080u;  // byte m in bytes 0 and 2; t(0) = 0 sign-filled in 1, 3
    // (0x8000 + delta) * 0x10001: the sign bit, and delta added to both halves of bits.
    constexpr u32 neg = 0x80008000u;
    E2M1Thresholds t;
    t.neg[0] = bits + neg + static_cast<u32>(E2M1_DELTA1) * 0x10001u;
    t.neg[1] = bits + prmt(E2M1_DELTA2_LO, E2M1_DELTA2_HI, table) + (neg + static_cast<u32>(E2M1_DELTA2) * 0x10001u);
    t.neg[2] = bits + prmt(E2M1_DELTA3_LO, E2M1_DELTA3_HI, table) + (neg + static_cast<u32>(E2M1_DELTA3) * 0x10001u);
    t.neg[3] = bits + prmt(E2M1_DELTA4_LO, E2M1_DELTA4_HI, table) + (neg + static_cast<u32>(E2M1_DELTA4) * 0x10001u);
    t.neg[4] = t.neg[2] + 0x00800080u;
    t.neg[5] = t.neg[3] + 0x00800080u;
    t.neg[6] = t.neg[2] + 0x01000100u;
    return t;
}

// The code bits of one pair of values, inverted, each at bits 15 and 31 (low value, high value).
// n_k, the sign of |v| - Tk, is set where |v| < Tk; the tests t_k = ~n_k form a thermometer
// (t7 => ... => t1), whose count c has b2 = t4, b1 = t2 ^ t4 ^ t6 and b0 = the parity of all
// seven. An odd number of inversions inverts a XOR, so ~b1 = n2 ^ n4 ^ n6, ~b0 = n1 ^ ... ^ n7.
struct PairCodeBits {
    u32 not_b0, not_b1, not_b2;
};

__device__ __forceinline__ PairCodeBits pair_code_bits(u32 values, const E2M1Thresholds& t) {
    u32 n[7];
#pragma unroll
    for (int k = 0; k < 7; ++k) n[k] = bf16x2_abs_add(values, t.neg[k]);
    const u32 not_b1 = n[1] ^ n[3] ^ n[5];
    return {n[0] ^ n[2] ^ n[4] ^ not_b1 ^ n[6], not_b1, n[3]};
}

// ORs bit `bit` (0..3) of each of the 8 nibbles of `acc` from a plane: bits 15 and 31 of the words
// of pairs 0..3 (elements 2i, 2i+1). Pairs 0, 1 give elements 0, 2 in place and 1, 3 in nibbles
// 5, 7; pairs 2, 3 give 4, 6 in place and 5, 7 in nibbles 1, 3 (swapped back by e2m1_nibbles).
template <int bit, bool inverted>
__device__ __forceinline__ u32 add_plane(u32 acc, u32 p0, u32 p1, u32 p2, u32 p3) {
    const u32 a = prmt(p0, p1, 0xFBD9u), b = prmt(p2, p3, 0xD9FBu);  // sign-filled bytes
    constexpr u32 ma = 0x10100101u << bit, mb = 0x01011010u << bit;
    return inverted ? acc | (~a & ma) | (~b & mb) : acc | (a & ma) | (b & mb);
}

__device__ __forceinline__ u32 e2m1_nibbles(u32 acc) {
    return (acc & 0x0F0F0F0Fu) | (prmt(acc, acc, 0x1032u) & 0xF0F0F0F0u);
}

// Steps 5-7 under a scale code in 1..0x7E, whose thresholds are t, for a half without NaN: the
// 8 E2M1 codes (element k in bits 4k..4k+3). The sign plane is the values' own sign bits.
__device__ __forceinline__ u32 half_codes(uint4 x, const E2M1Thresholds& t) {
    const PairCodeBits p0 = pair_code_bits(x.x, t), p1 = pair_code_bits(x.y, t), p2 = pair_code_bits(x.z, t),
                       p3 = pair_code_bits(x.w, t);
    u32 acc = add_plane<0, true>(0u, p0.not_b0, p1.not_b0, p2.not_b0, p3.not_b0);
    acc = add_plane<1, true>(acc, p0.not_b1, p1.not_b1, p2.not_b1, p3.not_b1);
    acc = add_plane<2, true>(acc, p0.not_b2, p1.not_b2, p2.not_b2, p3.not_b2);
    acc = add_plane<3, false>(acc, x.x, x.y, x.z, x.w);
    return e2m1_nibbles(acc);
}

// Steps 5-7 for a whole group: the codes of half 0 (x) and half 1 (y), each under its own amax
// and scale code. Groups with a NaN (the only ones whose halves' scales may differ), and zero or
// NaN scales, take the exact scalar path.
__device__ __forceinline__ uint2 group_codes(uint4 h0, uint4 h1, GroupAmax a, u32 code0, u32 code1) {
    if (!a.nan && code0 - 1u < 0x7Eu) {
        const E2M1Thresholds t = e2m1_thresholds(code0);
        return make_uint2(half_codes(h0, t), half_codes(h1, t));
    }
    return make_uint2(exact_half_codes(h0, a.amax.x, code0), exact_half_codes(h1, a.amax.y, code1));
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

// The E4M3 scale byte as a BF16 pair (both halves the same value; BF16 holds every E4M3 value
// exactly); a NaN byte gives a NaN pair.
__device__ __forceinline__ u32 e4m3_bf16x2(u32 scale_byte) {
    const u32 s = __float_as_uint(e4m3_signed_value(scale_byte)) >> 16;
    return s | s << 16;
}

// 8 consecutive NoPE values (codes as in e2m1x8_bf16x2) times a scale pair: exact, NaN if the scale is.
__device__ __forceinline__ uint4 e2m1x8_scaled(u32 codes, u32 scale) {
    const uint4 v = e2m1x8_bf16x2(codes);
    return make_uint4(bf16x2_mul_exact(v.x, scale), bf16x2_mul_exact(v.y, scale), bf16x2_mul_exact(v.z, scale),
                      bf16x2_mul_exact(v.w, scale));
}

// 8 consecutive NoPE values of one group (their codes as in e2m1x8_bf16x2, the group's scale
// byte) as canonical BF16 pairs: e2m1 x e4m3, exact.
__device__ __forceinline__ uint4 nvfp4_bf16x8(u32 codes, u32 scale_byte) {
    if (e4m3_byte_is_nan(scale_byte)) return make_uint4(0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u);
    return e2m1x8_scaled(codes, e4m3_bf16x2(scale_byte));
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
