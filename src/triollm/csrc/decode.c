/* Paged decode attention on CPU (model/cpu/decode.py tells what it computes and why):
   an AVX-512 one-pass path and a portable one (-DTRIOLLM_PORTABLE builds only the
   portable one), on OpenMP or the helper pool. */
#include "pool.h"

#include <string.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#include "decode_pair.h"

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
   (model/cpu/helpers.py); the portable path runs on the calling thread alone. */
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
            triollm_pool_run(&job->base, helpers);
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
