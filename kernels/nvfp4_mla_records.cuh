// What the decode kernels share about reading records through a pool's slot table (docs/format.md
// sections 3 and 9): a row's live entries.
#pragma once

#include "nvfp4_numerics.cuh"

// Live entries of a row of a pool's table: lens clamped to [0, k], or k without lens. (The pool's
// fields one by one: a reference to a Params member would copy Params to the stack.)
__device__ __forceinline__ i64 live_count(const void* lens, i64 lens_int64, i64 k, i64 row) {
    if (k == 0 || lens == nullptr) return k;
    const i64 n = lens_int64 ? static_cast<const i64*>(lens)[row] : static_cast<const int*>(lens)[row];
    return n < 0 ? 0 : (n > k ? k : n);
}
