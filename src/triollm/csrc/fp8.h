/* 8-bit float KV-cache elements (model/attention/kv_storage.py): e5m2 (fp16's top byte)
   and e4m3fn (bias 7, no infinities, largest 448), to and from fp32 as torch converts.

   Reading places the byte's exponent and mantissa at the top of an fp32's and rescales
   by the difference of the biases: exact for normal and subnormal values alike (fp32
   holds the subnormals as its own subnormals; a process that flushes those to zero reads
   them as zero, a loss below 2^-14 for e5m2 and 2^-6 for e4m3). Writing rounds to nearest
   even; e5m2 overflows to infinity and e4m3 saturates at 448, as torch's casts do. */
#ifndef TRIOLLM_FP8_H
#define TRIOLLM_FP8_H

#include <math.h>
#include <stdint.h>

static inline float fp8_bits_to_float(uint8_t byte, int shift, float rebias) {
    union { uint32_t u; float f; } value;
    value.u = ((uint32_t)(byte & 0x7f) << shift) | ((uint32_t)(byte & 0x80) << 24);
    return value.f * rebias;
}

static inline float e5m2_to_float(uint8_t byte) { return fp8_bits_to_float(byte, 21, 0x1p112f); }
static inline float e4m3_to_float(uint8_t byte) { return fp8_bits_to_float(byte, 20, 0x1p120f); }

#define FROM_E5M2(x) e5m2_to_float(x)
#define FROM_E4M3(x) e4m3_to_float(x)

/* |x|'s bits rounded to `mantissa` bits (nearest even) and rebiased, or the subnormal
   count of `step`s; `smallest_normal` is the format's, as fp32 bits. */
static inline uint32_t fp8_round(float x, int mantissa, uint32_t rebias,
                                 uint32_t smallest_normal, float step_inverse) {
    union { uint32_t u; float f; } value;
    value.f = fabsf(x);
    if (value.u < smallest_normal) return (uint32_t)rintf(value.f * step_inverse);
    const int dropped = 23 - mantissa;
    value.u += ((1u << (dropped - 1)) - 1u) + ((value.u >> dropped) & 1u);
    return (value.u >> dropped) - rebias;
}

static inline uint8_t float_to_e5m2(float x) {
    const uint8_t sign = signbit(x) ? 0x80 : 0;
    if (isnan(x)) return sign | 0x7f;
    const uint32_t bits = fp8_round(x, 2, (127 - 15) << 2, 0x38800000u, 0x1p16f);
    return sign | (uint8_t)(bits > 0x7b ? 0x7c : bits);  /* past 57344: infinity */
}

static inline uint8_t float_to_e4m3(float x) {
    const uint8_t sign = signbit(x) ? 0x80 : 0;
    if (isnan(x)) return sign | 0x7f;
    const uint32_t bits = fp8_round(x, 3, (127 - 7) << 3, 0x3c800000u, 0x1p9f);
    return sign | (uint8_t)(bits > 0x7e ? 0x7e : bits);  /* past 448: 448 */
}

#if defined(__AVX512F__) && !defined(TRIOLLM_PORTABLE)
#include <immintrin.h>

/* 16 e5m2 bytes: each the top byte of an fp16, widened by the hardware. */
static inline __m512 load16_e5m2(const uint8_t* p) {
    const __m256i halves = _mm256_slli_epi16(
        _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p)), 8);
    return _mm512_cvtph_ps(halves);
}

/* 16 e4m3 bytes times 2^-8: exponent and mantissa moved under an fp16's, the sign to
   its top, widened by the hardware (the attention scales its query and output by 2^8
   instead, exactly). Through fp32's bits, as the scalar reading does, e4m3's zeros and
   subnormals would be fp32 subnormals, and a multiply by one takes a microcode assist
   on Intel CPUs: the 8-bit cache's decode attention ran 6-8x slower than bf16's
   (benchmarks/kv_cache_dtype.py --kernel). */
static inline __m512 load16_e4m3_under_256(const uint8_t* p) {
    /* the byte at an fp16's top, shifted right arithmetically by one (the sign stays,
       a copy of it lands on the exponent's top bit, which the mask clears) */
    const __m256i top = _mm256_slli_epi16(
        _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p)), 8);
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(top, 1),
                                            _mm256_set1_epi16((short)0xBFFF)));
}
#endif

#endif
