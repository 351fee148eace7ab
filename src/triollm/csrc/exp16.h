/* exp16: e^x of 16 floats at once, for the kernels' AVX-512 paths. */
#ifndef TRIOLLM_EXP16_H
#define TRIOLLM_EXP16_H

#include <immintrin.h>
/* e^x for x <= 0: x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial in r, scaled by
   2^n; within 2 ulp of expf on [-87, 0], and 0 below (where expf is below 2^-125). */
static inline __m512 exp16(__m512 x) {
    const __m512 floor_ = _mm512_set1_ps(-87.0f);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, floor_, _CMP_LT_OQ);
    x = _mm512_max_ps(x, floor_);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps((__mmask16)~tiny, _mm512_scalef_ps(p, n));
}

#endif
