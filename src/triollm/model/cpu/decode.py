"""Decode attention on CPU as a small C kernel, built on first use with the machine's C
compiler and called through ctypes.

Each single-token query attends over exactly its own sequence's blocks, read in place
from the paged cache: no padding to the longest sequence of the batch, no gathered copy,
and about 10 µs of call overhead against the ~0.3 ms a ``torch.compile``'d function
spends in its guards and wrappers per layer. Work is split over (sequence, KV head)
pairs on torch's OpenMP runtime with torch's thread count, so the compute-thread policy
(``cpu_threads.py``) governs it too; while that policy computes on one thread beside
busy cores, the AVX-512 path's pairs go to cpu_helpers.py's pool instead. Scores and
sums are fp32; the cache may be fp32 or bf16.

Two paths share the source. Where the compiler targets AVX-512 and the head size is a
multiple of 16 (up to 256), one pass over the blocks keeps a query head's output row in
vector registers and folds each run of up to 16 scores into an online softmax with a
vector exp: no scratch memory, K and V each read once. Elsewhere a portable loop (auto-
vectorised by the compiler) writes all scores, takes the softmax, then sums V. Tests build
the portable one here too (``_build(portable=True)``), so CPUs without AVX-512 run code
that was checked.

A step of decodes only takes one call a layer (``decode_step``): the step's keys and values
are written into the cache, the queries read and the output written in the model's
dtype with the strides the model's projections give them, all in C. Around the kernel
the layer's torch path makes about ten calls (the cache writes, conversions, slicing, a
copy out); on the 27M Llama's shapes a layer took 9.7 instead of 23.5 µs for one
sequence and 23.8 instead of 41.8 µs for four.

The kernel is compiled for the CPU it runs on (native_build.py). Without a working
compiler ``load_kernel`` returns None and the runner falls back to the compiled or
gathering path.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from triollm.model.cpu.build import AVX512_EXP16, FLAGS, build, load_checked
from triollm.model.cpu.helpers import POOL_SOURCE, PooledFunction

__all__ = ["CpuDecodeKernel", "load_kernel"]

_SOURCE = POOL_SOURCE + r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

static inline float bf16_to_float(uint16_t bits) {
    union { uint32_t u; float f; } value;
    value.u = ((uint32_t)bits) << 16;
    return value.f;
}

#define AS_FLOAT(x) (x)
#define FROM_BF16(x) bf16_to_float(x)

/* One (sequence, KV head): its `groups` query heads attend over tokens [start, ctx),
   read block by block through the sequence's row of the block table (no division per
   token). Four tokens' dot products are summed at once so their reductions overlap. */
#define DEFINE_ATTEND(NAME, CACHE_T, LOAD)                                              \
static inline __attribute__((always_inline)) void NAME(                                 \
    const float* query, const CACHE_T* keys, const CACHE_T* vals,                       \
    const int64_t* row_table, float* scores, float* out,                                \
    int64_t groups, int64_t block_size, int64_t dim, int64_t start, int64_t ctx,        \
    float scale, float softcap)                                                         \
{                                                                                       \
    const int64_t span = ctx - start;                                                   \
    for (int64_t blk = start / block_size; blk * block_size < ctx; blk++) {            \
        const int64_t first = blk * block_size;                                         \
        const CACHE_T* kb = keys + row_table[blk] * block_size * dim;                   \
        const int64_t begin = first < start ? start - first : 0;                        \
        const int64_t end = ctx - first < block_size ? ctx - first : block_size;        \
        for (int64_t g = 0; g < groups; g++) {                                          \
            const float* qv = query + g * dim;                                          \
            float* row = scores + g * span + (first - start);                           \
            int64_t j = begin;                                                          \
            for (; j + 4 <= end; j += 4) {                                              \
                const CACHE_T* k0 = kb + j * dim;                                       \
                const CACHE_T* k1 = k0 + dim;                                           \
                const CACHE_T* k2 = k1 + dim;                                           \
                const CACHE_T* k3 = k2 + dim;                                           \
                float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;                       \
                _Pragma("omp simd reduction(+:d0,d1,d2,d3)")                            \
                for (int64_t d = 0; d < dim; d++) {                                     \
                    const float q = qv[d];                                              \
                    d0 += q * LOAD(k0[d]); d1 += q * LOAD(k1[d]);                       \
                    d2 += q * LOAD(k2[d]); d3 += q * LOAD(k3[d]);                       \
                }                                                                       \
                row[j] = d0 * scale; row[j + 1] = d1 * scale;                           \
                row[j + 2] = d2 * scale; row[j + 3] = d3 * scale;                       \
            }                                                                           \
            for (; j < end; j++) {                                                      \
                const CACHE_T* k0 = kb + j * dim;                                       \
                float d0 = 0.0f;                                                        \
                _Pragma("omp simd reduction(+:d0)")                                     \
                for (int64_t d = 0; d < dim; d++) d0 += qv[d] * LOAD(k0[d]);            \
                row[j] = d0 * scale;                                                    \
            }                                                                           \
        }                                                                               \
    }                                                                                   \
    for (int64_t g = 0; g < groups; g++) {                                              \
        float* row = scores + g * span;                                                 \
        if (softcap > 0.0f)                                                             \
            for (int64_t i = 0; i < span; i++) row[i] = tanhf(row[i] / softcap) * softcap; \
        float top = -INFINITY;                                                          \
        for (int64_t i = 0; i < span; i++) top = row[i] > top ? row[i] : top;           \
        float total = 0.0f;                                                             \
        for (int64_t i = 0; i < span; i++) { row[i] = expf(row[i] - top); total += row[i]; } \
        const float inverse = 1.0f / total;                                             \
        for (int64_t i = 0; i < span; i++) row[i] *= inverse;                           \
    }                                                                                   \
    for (int64_t i = 0; i < groups * dim; i++) out[i] = 0.0f;                           \
    for (int64_t blk = start / block_size; blk * block_size < ctx; blk++) {            \
        const int64_t first = blk * block_size;                                         \
        const CACHE_T* vb = vals + row_table[blk] * block_size * dim;                   \
        const int64_t begin = first < start ? start - first : 0;                        \
        const int64_t end = ctx - first < block_size ? ctx - first : block_size;        \
        for (int64_t g = 0; g < groups; g++) {                                          \
            const float* weights = scores + g * span + (first - start);                 \
            float* sum = out + g * dim;                                                 \
            for (int64_t j = begin; j < end; j++) {                                     \
                const CACHE_T* v = vb + j * dim;                                        \
                const float w = weights[j];                                             \
                _Pragma("omp simd")                                                     \
                for (int64_t d = 0; d < dim; d++) sum[d] += w * LOAD(v[d]);             \
            }                                                                           \
        }                                                                               \
    }                                                                                   \
}

DEFINE_ATTEND(attend_f32, float, AS_FLOAT)
DEFINE_ATTEND(attend_bf16, uint16_t, FROM_BF16)

#if defined(__AVX512F__) && !defined(TRIOLLM_PORTABLE)
#include <immintrin.h>
#define HAVE_AVX512 1

static inline __m512 load16_f32(const float* p) { return _mm512_loadu_ps(p); }

static inline __m512 load16_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

""" + AVX512_EXP16 + r"""
/* The same (sequence, KV head) work in one pass over the blocks with an online softmax:
   up to 16 tokens' scores at a time in one vector, the running maximum and sum, and the
   output rows in registers (dim = 16 * CHUNKS; CHUNKS 0 means dim / 16, read at run
   time). No scratch memory: `scores` is there only so one call macro serves both paths. */
#define DEFINE_ATTEND16(NAME, CACHE_T, LOAD16, CHUNKS)                                  \
static void NAME(                                                                       \
    const float* query, const CACHE_T* keys, const CACHE_T* vals,                       \
    const int64_t* row_table, float* scores, float* out,                                \
    int64_t groups, int64_t block_size, int64_t dim, int64_t start, int64_t ctx,        \
    float scale, float softcap)                                                         \
{                                                                                       \
    (void)scores;                                                                       \
    const int64_t chunks = CHUNKS > 0 ? CHUNKS : dim / 16;                              \
    for (int64_t g = 0; g < groups; g++) {                                              \
        __m512 q[CHUNKS > 0 ? CHUNKS : 16], acc[CHUNKS > 0 ? CHUNKS : 16];              \
        for (int64_t c = 0; c < chunks; c++) {                                          \
            q[c] = _mm512_mul_ps(_mm512_loadu_ps(query + g * dim + 16 * c),             \
                                 _mm512_set1_ps(scale));                                \
            acc[c] = _mm512_setzero_ps();                                               \
        }                                                                               \
        float top = -INFINITY, total = 0.0f;                                            \
        float weights[16] __attribute__((aligned(64)));                                 \
        for (int64_t blk = start / block_size; blk * block_size < ctx; blk++) {        \
            const int64_t first = blk * block_size;                                     \
            const CACHE_T* kb = keys + row_table[blk] * block_size * dim;               \
            const CACHE_T* vb = vals + row_table[blk] * block_size * dim;               \
            const int64_t begin = first < start ? start - first : 0;                    \
            const int64_t end = ctx - first < block_size ? ctx - first : block_size;    \
            for (int64_t j0 = begin; j0 < end; j0 += 16) {                              \
                const int64_t count = end - j0 < 16 ? end - j0 : 16;                    \
                for (int64_t t = 0; t < count; t++) {                                   \
                    const CACHE_T* k = kb + (j0 + t) * dim;                             \
                    __m512 dot = _mm512_mul_ps(q[0], LOAD16(k));                        \
                    for (int64_t c = 1; c < chunks; c++)                                \
                        dot = _mm512_fmadd_ps(q[c], LOAD16(k + 16 * c), dot);           \
                    weights[t] = _mm512_reduce_add_ps(dot);                             \
                }                                                                       \
                if (softcap > 0.0f)                                                     \
                    for (int64_t t = 0; t < count; t++)                                 \
                        weights[t] = tanhf(weights[t] / softcap) * softcap;             \
                const __mmask16 valid = (__mmask16)((1u << count) - 1u);                \
                const __m512 s = _mm512_maskz_load_ps(valid, weights);                  \
                const float block_top = _mm512_mask_reduce_max_ps(valid, s);            \
                const float new_top = block_top > top ? block_top : top;                \
                const __m512 p = _mm512_maskz_mov_ps(                                   \
                    valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_top))));           \
                if (new_top > top) {                                                    \
                    const float shrink = expf(top - new_top);                           \
                    total *= shrink;                                                    \
                    for (int64_t c = 0; c < chunks; c++)                                \
                        acc[c] = _mm512_mul_ps(acc[c], _mm512_set1_ps(shrink));         \
                    top = new_top;                                                      \
                }                                                                       \
                total += _mm512_reduce_add_ps(p);                                       \
                _mm512_store_ps(weights, p);                                            \
                for (int64_t t = 0; t < count; t++) {                                   \
                    const CACHE_T* v = vb + (j0 + t) * dim;                             \
                    const __m512 w = _mm512_set1_ps(weights[t]);                        \
                    for (int64_t c = 0; c < chunks; c++)                                \
                        acc[c] = _mm512_fmadd_ps(w, LOAD16(v + 16 * c), acc[c]);        \
                }                                                                       \
            }                                                                           \
        }                                                                               \
        const __m512 inverse = _mm512_set1_ps(1.0f / total);                            \
        for (int64_t c = 0; c < chunks; c++)                                            \
            _mm512_storeu_ps(out + g * dim + 16 * c, _mm512_mul_ps(acc[c], inverse));   \
    }                                                                                   \
}

DEFINE_ATTEND16(attend16_f32_d64, float, load16_f32, 4)
DEFINE_ATTEND16(attend16_bf16_d64, uint16_t, load16_bf16, 4)
DEFINE_ATTEND16(attend16_f32_d128, float, load16_f32, 8)
DEFINE_ATTEND16(attend16_bf16_d128, uint16_t, load16_bf16, 8)
DEFINE_ATTEND16(attend16_f32, float, load16_f32, 0)
DEFINE_ATTEND16(attend16_bf16, uint16_t, load16_bf16, 0)
#else
#define HAVE_AVX512 0
#endif

#define CALL_ATTEND_INTO(FUNCTION, CACHE_T, DEST)                                       \
    FUNCTION(query + (b * q_heads + h * groups) * dim,                                  \
             (const CACHE_T*)key_cache + h * num_blocks * block_size * dim,             \
             (const CACHE_T*)value_cache + h * num_blocks * block_size * dim,           \
             tables + b * max_blocks, scores, DEST,                                     \
             groups, block_size, dim, start, ctx, scale, softcap)
#define CALL_ATTEND(FUNCTION, CACHE_T)                                                  \
    CALL_ATTEND_INTO(FUNCTION, CACHE_T, out + (b * q_heads + h * groups) * dim)

/* Which path this build runs for head size `dim`: 1 the vector one, 0 the portable. */
int triollm_paged_decode_vectorized(int64_t dim) {
    return HAVE_AVX512 && dim % 16 == 0 && dim <= 256;
}

int triollm_paged_decode(
    const float* query, const void* key_cache, const void* value_cache,
    const int64_t* tables, const int64_t* context_lens, float* out,
    int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t num_blocks,
    int64_t block_size, int64_t dim, int64_t max_blocks, float scale,
    int64_t window, float softcap, int cache_is_bf16, int threads)
{
    const int64_t groups = q_heads / kv_heads;
    const int vectorized = triollm_paged_decode_vectorized(dim);
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; b++)
        longest = context_lens[b] > longest ? context_lens[b] : longest;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        float* scores = vectorized ? NULL
            : (float*)malloc(sizeof(float) * (size_t)(groups * (longest + 1)));
        if (!vectorized && scores == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t b = 0; b < batch; b++) {
            for (int64_t h = 0; h < kv_heads; h++) {
                const int64_t ctx = context_lens[b];
                const int64_t start = (window > 0 && ctx > window) ? ctx - window : 0;
                if (ctx - start <= 0) continue;
#if HAVE_AVX512
                if (vectorized) {
                    if (cache_is_bf16) {
                        if (dim == 64) CALL_ATTEND(attend16_bf16_d64, uint16_t);
                        else if (dim == 128) CALL_ATTEND(attend16_bf16_d128, uint16_t);
                        else CALL_ATTEND(attend16_bf16, uint16_t);
                    } else {
                        if (dim == 64) CALL_ATTEND(attend16_f32_d64, float);
                        else if (dim == 128) CALL_ATTEND(attend16_f32_d128, float);
                        else CALL_ATTEND(attend16_f32, float);
                    }
                    continue;
                }
#endif
                if (scores == NULL) continue;
                if (cache_is_bf16) {
                    CALL_ATTEND(attend_bf16, uint16_t);
                } else {
                    CALL_ATTEND(attend_f32, float);
                }
            }
        }
        free(scores);
    }
    return failed;
}

typedef struct {
    pool_job base;
    /* query, tables and context_lens are the job's own copies (a helper may read them
       after the call); the caches must outlive the pool's next drain. */
    const float* query;
    const void* key_cache;
    const void* value_cache;
    const int64_t* tables;
    const int64_t* context_lens;
    float* out;
    int64_t q_heads, kv_heads, num_blocks, block_size, dim, max_blocks, window;
    float scale, softcap;
    int cache_is_bf16;
} decode_job;

#if HAVE_AVX512
/* One (sequence, KV head) on the vector path; a helper computes into a buffer of its
   own and copies it out only once pool_commit says the unit is still its own. */
static void decode_job_unit(pool_job* base, int64_t unit, int helper) {
    const decode_job* job = (const decode_job*)base;
    const float* query = job->query;
    const void* key_cache = job->key_cache;
    const void* value_cache = job->value_cache;
    const int64_t* tables = job->tables;
    const int64_t q_heads = job->q_heads, num_blocks = job->num_blocks;
    const int64_t block_size = job->block_size, dim = job->dim, max_blocks = job->max_blocks;
    const int64_t groups = q_heads / job->kv_heads;
    const int64_t b = unit / job->kv_heads, h = unit % job->kv_heads;
    const float scale = job->scale, softcap = job->softcap;
    const int64_t ctx = job->context_lens[b];
    const int64_t start = (job->window > 0 && ctx > job->window) ? ctx - job->window : 0;
    float* target = job->out + (b * q_heads + h * groups) * dim;
    float own[helper ? groups * dim : 1];
    float* dest = helper ? own : target;
    float* scores = NULL;
    if (ctx - start > 0) {
        if (job->cache_is_bf16) {
            if (dim == 64) CALL_ATTEND_INTO(attend16_bf16_d64, uint16_t, dest);
            else if (dim == 128) CALL_ATTEND_INTO(attend16_bf16_d128, uint16_t, dest);
            else CALL_ATTEND_INTO(attend16_bf16, uint16_t, dest);
        } else {
            if (dim == 64) CALL_ATTEND_INTO(attend16_f32_d64, float, dest);
            else if (dim == 128) CALL_ATTEND_INTO(attend16_f32_d128, float, dest);
            else CALL_ATTEND_INTO(attend16_f32, float, dest);
        }
    }
    if (helper && pool_commit(base, unit) && ctx - start > 0)
        memcpy(target, own, sizeof(float) * (size_t)(groups * dim));
}
#endif

/* triollm_paged_decode on the calling thread and up to `helpers` pool helpers
   (cpu_helpers.py); the portable path runs on the calling thread alone. */
int triollm_paged_decode_pooled(
    const float* query, const void* key_cache, const void* value_cache,
    const int64_t* tables, const int64_t* context_lens, float* out,
    int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t num_blocks,
    int64_t block_size, int64_t dim, int64_t max_blocks, float scale,
    int64_t window, float softcap, int cache_is_bf16, int helpers)
{
#if HAVE_AVX512
    if (triollm_paged_decode_vectorized(dim)) {
        const int64_t units = batch * kv_heads;
        const size_t head = (sizeof(decode_job) + (size_t)units + 63) & ~(size_t)63;
        const size_t query_bytes = sizeof(float) * (size_t)(batch * q_heads * dim);
        const size_t table_bytes = sizeof(int64_t) * (size_t)(batch * max_blocks);
        decode_job* job = (decode_job*)malloc(head + query_bytes + table_bytes
                                              + sizeof(int64_t) * (size_t)batch);
        if (job != NULL) {
            char* copies = (char*)job + head;
            memcpy(copies, query, query_bytes);
            memcpy(copies + query_bytes, tables, table_bytes);
            memcpy(copies + query_bytes + table_bytes, context_lens,
                   sizeof(int64_t) * (size_t)batch);
            job->base.run = decode_job_unit;
            job->base.units = units;
            job->base.state = (_Atomic unsigned char*)(job + 1);
            job->query = (const float*)copies;
            job->tables = (const int64_t*)(copies + query_bytes);
            job->context_lens = (const int64_t*)(copies + query_bytes + table_bytes);
            job->key_cache = key_cache;
            job->value_cache = value_cache;
            job->out = out;
            job->q_heads = q_heads;
            job->kv_heads = kv_heads;
            job->num_blocks = num_blocks;
            job->block_size = block_size;
            job->dim = dim;
            job->max_blocks = max_blocks;
            job->window = window;
            job->scale = scale;
            job->softcap = softcap;
            job->cache_is_bf16 = cache_is_bf16;
            pool_run(&job->base, helpers);
            return 0;
        }
    }
#endif
    (void)helpers;
    return triollm_paged_decode(query, key_cache, value_cache, tables, context_lens, out,
                                batch, q_heads, kv_heads, num_blocks, block_size, dim,
                                max_blocks, scale, window, softcap, cache_is_bf16, 1);
}

/* Rounded to nearest even, NaN kept a NaN: what torch's float-to-bf16 conversion does. */
static inline uint16_t float_to_bf16(float number) {
    union { uint32_t u; float f; } value;
    value.f = number;
    if ((value.u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    value.u += 0x7fffu + ((value.u >> 16) & 1u);
    return (uint16_t)(value.u >> 16);
}

/* A layer's whole attention for a step of decodes only: token t's keys and values go
   into the cache at slots[t], then each token's query attends over its sequence. The
   queries, keys, values and the output are in the cache's dtype, as [heads, tokens, dim]
   with any head and token strides (in elements; dim contiguous). */
static int decode_step(
    const void* query, int64_t q_head_stride, int64_t q_token_stride,
    const void* keys, int64_t k_head_stride, int64_t k_token_stride,
    const void* values, int64_t v_head_stride, int64_t v_token_stride,
    void* out, int64_t out_head_stride, int64_t out_token_stride,
    const int64_t* slots, void* key_cache, void* value_cache,
    const int64_t* tables, const int64_t* context_lens,
    int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t num_blocks,
    int64_t block_size, int64_t dim, int64_t max_blocks, float scale,
    int64_t window, float softcap, int cache_is_bf16, int threads, int pooled)
{
    const size_t element = cache_is_bf16 ? 2 : 4;
    const int64_t head_size = num_blocks * block_size * dim;
    for (int64_t t = 0; t < batch; t++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            const size_t cache_at = (size_t)(h * head_size + slots[t] * dim) * element;
            memcpy((char*)key_cache + cache_at,
                   (const char*)keys + (size_t)(h * k_head_stride + t * k_token_stride) * element,
                   (size_t)dim * element);
            memcpy((char*)value_cache + cache_at,
                   (const char*)values + (size_t)(h * v_head_stride + t * v_token_stride) * element,
                   (size_t)dim * element);
        }
    }
    const size_t rows = (size_t)(batch * q_heads * dim);
    float* buffer = (float*)malloc(2 * rows * sizeof(float));
    if (buffer == NULL) return 1;
    float* flat_query = buffer;
    float* flat_out = buffer + rows;
    for (int64_t t = 0; t < batch; t++) {
        for (int64_t h = 0; h < q_heads; h++) {
            float* row = flat_query + (t * q_heads + h) * dim;
            const int64_t at = h * q_head_stride + t * q_token_stride;
            if (cache_is_bf16) {
                const uint16_t* source = (const uint16_t*)query + at;
                for (int64_t d = 0; d < dim; d++) row[d] = bf16_to_float(source[d]);
            } else {
                memcpy(row, (const float*)query + at, (size_t)dim * sizeof(float));
            }
        }
    }
    const int failed = pooled
        ? triollm_paged_decode_pooled(flat_query, key_cache, value_cache, tables,
                                      context_lens, flat_out, batch, q_heads, kv_heads,
                                      num_blocks, block_size, dim, max_blocks, scale, window,
                                      softcap, cache_is_bf16, threads)
        : triollm_paged_decode(flat_query, key_cache, value_cache, tables, context_lens,
                               flat_out, batch, q_heads, kv_heads, num_blocks, block_size,
                               dim, max_blocks, scale, window, softcap, cache_is_bf16,
                               threads);
    for (int64_t t = 0; t < batch && !failed; t++) {
        for (int64_t h = 0; h < q_heads; h++) {
            const float* row = flat_out + (t * q_heads + h) * dim;
            const int64_t at = h * out_head_stride + t * out_token_stride;
            if (cache_is_bf16) {
                uint16_t* target = (uint16_t*)out + at;
                for (int64_t d = 0; d < dim; d++) target[d] = float_to_bf16(row[d]);
            } else {
                memcpy((float*)out + at, row, (size_t)dim * sizeof(float));
            }
        }
    }
    free(buffer);
    return failed;
}

#define DECODE_STEP_PARAMETERS                                                          \
    const void* query, int64_t q_head_stride, int64_t q_token_stride,                   \
    const void* keys, int64_t k_head_stride, int64_t k_token_stride,                    \
    const void* values, int64_t v_head_stride, int64_t v_token_stride,                  \
    void* out, int64_t out_head_stride, int64_t out_token_stride,                       \
    const int64_t* slots, void* key_cache, void* value_cache,                           \
    const int64_t* tables, const int64_t* context_lens,                                 \
    int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t num_blocks,               \
    int64_t block_size, int64_t dim, int64_t max_blocks, float scale,                   \
    int64_t window, float softcap, int cache_is_bf16
#define DECODE_STEP_ARGUMENTS                                                           \
    query, q_head_stride, q_token_stride, keys, k_head_stride, k_token_stride,          \
    values, v_head_stride, v_token_stride, out, out_head_stride, out_token_stride,      \
    slots, key_cache, value_cache, tables, context_lens, batch, q_heads, kv_heads,      \
    num_blocks, block_size, dim, max_blocks, scale, window, softcap, cache_is_bf16

int triollm_decode_step(DECODE_STEP_PARAMETERS, int threads) {
    return decode_step(DECODE_STEP_ARGUMENTS, threads, 0);
}

int triollm_decode_step_pooled(DECODE_STEP_PARAMETERS, int helpers) {
    return decode_step(DECODE_STEP_ARGUMENTS, helpers, 1);
}
"""

def _build(portable: bool = False) -> Path:
    """The compiled kernel's path; ``portable`` leaves out the AVX-512 path, so a test
    can run here what a CPU without AVX-512 runs."""
    return build("paged_decode", _SOURCE, [*FLAGS, "-DTRIOLLM_PORTABLE"] if portable else FLAGS)


class CpuDecodeKernel:
    """``paged_decode_attention``'s signature, run by the C kernel."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self._function = PooledFunction(
            library, "triollm_paged_decode",
            [pointer] * 6 + [i64] * 7 + [f32, i64, f32, ctypes.c_int, ctypes.c_int],
            ctypes.c_int)
        self._step = PooledFunction(
            library, "triollm_decode_step",
            ([pointer, i64, i64] * 4 + [pointer] * 5 + [i64] * 7
             + [f32, i64, f32, ctypes.c_int, ctypes.c_int]),
            ctypes.c_int)
        self._vectorized = library.triollm_paged_decode_vectorized
        self._vectorized.argtypes = [ctypes.c_int64]
        self._vectorized.restype = ctypes.c_int

    def decode_step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    slot_mapping: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, scale: float, sliding_window: int | None,
                    softcap: float | None) -> torch.Tensor | None:
        """A layer's attention for a step of decodes only, in one call: ``key`` and
        ``value`` (``[Hkv, T, D]``) written into the caches at ``slot_mapping``, then the
        queries (``[Hq, T, D]``) over their sequences; returns ``[Hq, T, D]`` laid out
        as ``query`` is. The queries, keys and values must be in the caches' dtype with
        contiguous heads, and the tables and lengths int64 and contiguous; where they
        are not, returns None and writes nothing."""
        dtype = key_cache.dtype
        if not (query.dtype == key.dtype == value.dtype == value_cache.dtype == dtype
                and dtype in (torch.float32, torch.bfloat16)
                and query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
                and key_cache.is_contiguous() and value_cache.is_contiguous()
                and block_tables.dtype == context_lens.dtype == slot_mapping.dtype
                == torch.int64 and block_tables.is_contiguous()
                and context_lens.is_contiguous() and slot_mapping.is_contiguous()):
            return None
        out = torch.empty_like(query)  # query's strides, or contiguous: dim is contiguous
        q_heads, batch, dim = query.shape
        kv_heads, num_blocks, block_size, _ = key_cache.shape
        failed = self._step(
            query.data_ptr(), query.stride(0), query.stride(1),
            key.data_ptr(), key.stride(0), key.stride(1),
            value.data_ptr(), value.stride(0), value.stride(1),
            out.data_ptr(), out.stride(0), out.stride(1),
            slot_mapping.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            block_tables.data_ptr(), context_lens.data_ptr(), batch, q_heads, kv_heads,
            num_blocks, block_size, dim, block_tables.shape[1], scale, sliding_window or 0,
            softcap or 0.0, int(dtype == torch.bfloat16))
        if failed:
            raise MemoryError("the CPU decode kernel could not allocate its scratch space")
        return out

    def vectorized(self, head_size: int) -> bool:
        """Whether heads of ``head_size`` take the AVX-512 path (else the portable one)."""
        return bool(self._vectorized(head_size))

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, sliding_window: int | None,
                 softcap: float | None) -> torch.Tensor:
        """Single-token queries ``[B, Hq, D]`` over their sequences' blocks."""
        if key_cache.dtype not in (torch.float32, torch.bfloat16) or (
                value_cache.dtype != key_cache.dtype):
            raise TypeError(f"the CPU decode kernel takes fp32 or bf16 caches, got "
                            f"{key_cache.dtype}")
        query = query.to(torch.float32).contiguous()
        tables = block_tables.to(torch.int64).contiguous()
        lens = context_lens.to(torch.int64).contiguous()
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            raise ValueError("the CPU decode kernel reads contiguous caches")
        batch, q_heads, dim = query.shape
        kv_heads, num_blocks, block_size, _ = key_cache.shape
        out = torch.empty_like(query)
        if batch == 0:
            return out
        failed = self._function(
            query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            tables.data_ptr(), lens.data_ptr(), out.data_ptr(), batch, q_heads, kv_heads,
            num_blocks, block_size, dim, tables.shape[1], scale,
            sliding_window or 0, softcap or 0.0, int(key_cache.dtype == torch.bfloat16))
        if failed:
            raise MemoryError("the CPU decode kernel could not allocate its scratch space")
        return out


def _agrees_with_torch(kernel: CpuDecodeKernel) -> bool:
    """The kernel's answer on small random inputs (GQA, a sliding window, softcap, fp32
    and bf16 caches, head sizes that take each path) against ``paged_decode_attention``
    run eagerly."""
    from triollm.model.attention.torch_decode import paged_decode_attention

    generator = torch.Generator().manual_seed(0)
    cases = ((torch.float32, None, None), (torch.bfloat16, 9, 30.0))
    for dim in (8, 16, 64, 128):
        for dtype, window, softcap in cases:
            query = torch.randn(3, 4, dim, generator=generator)
            keys = torch.randn(2, 8, 4, dim, generator=generator).to(dtype)
            values = torch.randn(2, 8, 4, dim, generator=generator).to(dtype)
            tables = torch.tensor([[5, 2, 7, 0], [1, 3, 0, 0], [6, 4, 0, 0]])
            lens = torch.tensor([15, 7, 1])
            expected = paged_decode_attention(query, keys.float(), values.float(), tables,
                                              lens, 0.25, window, softcap)
            got = kernel(query, keys, values, tables, lens, 0.25, window, softcap)
            if not torch.allclose(got, expected, atol=1e-5, rtol=1e-4):
                return False
    return True


@cache
def load_kernel() -> CpuDecodeKernel | None:
    """The kernel for this machine, built on first use and checked against torch; None
    where it cannot be built (no C compiler, say) or disagrees, with the reason logged."""
    return load_checked("paged_decode", _SOURCE, "CPU decode attention kernel",
                        CpuDecodeKernel, _agrees_with_torch)
