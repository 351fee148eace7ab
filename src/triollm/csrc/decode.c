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
/* The cache's element type (model/cpu/decode.py passes it). */
enum { CACHE_F32 = 0, CACHE_BF16 = 1, CACHE_E5M2 = 2, CACHE_E4M3 = 3 };

#define CALL_PORTABLE(KIND, DEST)                                                       \
    do {                                                                                \
        switch (KIND) {                                                                 \
        case CACHE_BF16: CALL_ATTEND_INTO(attend_bf16, uint16_t, DEST); break;          \
        case CACHE_E5M2: CALL_ATTEND_INTO(attend_e5m2, uint8_t, DEST); break;           \
        case CACHE_E4M3: CALL_ATTEND_INTO(attend_e4m3, uint8_t, DEST); break;           \
        default: CALL_ATTEND_INTO(attend_f32, float, DEST);                             \
        }                                                                               \
    } while (0)
#define CALL_VECTOR_SIZES(NAME, CACHE_T, DEST)                                          \
    do {                                                                                \
        if (dim == 64) CALL_ATTEND_INTO(NAME##_d64, CACHE_T, DEST);                     \
        else if (dim == 128) CALL_ATTEND_INTO(NAME##_d128, CACHE_T, DEST);              \
        else CALL_ATTEND_INTO(NAME, CACHE_T, DEST);                                     \
    } while (0)
#define CALL_VECTOR(KIND, DEST)                                                         \
    do {                                                                                \
        switch (KIND) {                                                                 \
        case CACHE_BF16: CALL_VECTOR_SIZES(attend16_bf16, uint16_t, DEST); break;       \
        case CACHE_E5M2: CALL_VECTOR_SIZES(attend16_e5m2, uint8_t, DEST); break;        \
        case CACHE_E4M3: CALL_VECTOR_SIZES(attend16_e4m3, uint8_t, DEST); break;        \
        default: CALL_VECTOR_SIZES(attend16_f32, float, DEST);                          \
        }                                                                               \
    } while (0)

/* Which path this build runs for head size `dim`: 1 the vector one, 0 the portable. */
int triollm_paged_decode_vectorized(int64_t dim) {
    return HAVE_AVX512 && dim % 16 == 0 && dim <= 256;
}

int triollm_paged_decode(
    const float* query, const void* key_cache, const void* value_cache,
    const int64_t* tables, const int64_t* context_lens, float* out,
    int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t num_blocks,
    int64_t block_size, int64_t dim, int64_t max_blocks, float scale,
    int64_t window, float softcap, int cache_kind, int threads)
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
                float* dest = out + (b * q_heads + h * groups) * dim;
#if HAVE_AVX512
                if (vectorized) {
                    CALL_VECTOR(cache_kind, dest);
                    continue;
                }
#endif
                if (scores == NULL) continue;
                CALL_PORTABLE(cache_kind, dest);
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
    int cache_kind;
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
    if (ctx - start > 0) CALL_VECTOR(job->cache_kind, dest);
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
    int64_t window, float softcap, int cache_kind, int helpers)
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
            job->cache_kind = cache_kind;
            triollm_pool_run(&job->base, helpers);
            return 0;
        }
    }
#endif
    (void)helpers;
    return triollm_paged_decode(query, key_cache, value_cache, tables, context_lens, out,
                                batch, q_heads, kv_heads, num_blocks, block_size, dim,
                                max_blocks, scale, window, softcap, cache_kind, 1);
}

/* Rounded to nearest even, NaN kept a NaN: what torch's float-to-bf16 conversion does. */
static inline uint16_t float_to_bf16(float number) {
    union { uint32_t u; float f; } value;
    value.f = number;
    if ((value.u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    value.u += 0x7fffu + ((value.u >> 16) & 1u);
    return (uint16_t)(value.u >> 16);
}

static size_t cache_element(int cache_kind) {
    return cache_kind == CACHE_F32 ? 4 : cache_kind == CACHE_BF16 ? 2 : 1;
}

/* `dim` elements of the model's dtype (bf16 or fp32) into the cache's, as torch casts. */
static void store_row(void* target, const void* source, int64_t dim, int io_is_bf16,
                      int cache_kind) {
    if (cache_kind == (io_is_bf16 ? CACHE_BF16 : CACHE_F32)) {
        memcpy(target, source, (size_t)dim * cache_element(cache_kind));
        return;
    }
    for (int64_t d = 0; d < dim; d++) {
        const float x = io_is_bf16 ? bf16_to_float(((const uint16_t*)source)[d])
                                   : ((const float*)source)[d];
        switch (cache_kind) {
        case CACHE_F32: ((float*)target)[d] = x; break;
        case CACHE_BF16: ((uint16_t*)target)[d] = float_to_bf16(x); break;
        case CACHE_E5M2: ((uint8_t*)target)[d] = float_to_e5m2(x); break;
        default: ((uint8_t*)target)[d] = float_to_e4m3(x);
        }
    }
}

/* A layer's whole attention for a step of decodes only: token t's keys and values go
   into the cache at slots[t] (converted to its element type), then each token's query
   attends over its sequence. The queries, keys, values and the output are in the
   model's dtype (bf16 or fp32), as [heads, tokens, dim] with any head and token strides
   (in elements; dim contiguous). */
static int decode_step(
    const void* query, int64_t q_head_stride, int64_t q_token_stride,
    const void* keys, int64_t k_head_stride, int64_t k_token_stride,
    const void* values, int64_t v_head_stride, int64_t v_token_stride,
    void* out, int64_t out_head_stride, int64_t out_token_stride,
    const int64_t* slots, void* key_cache, void* value_cache,
    const int64_t* tables, const int64_t* context_lens,
    int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t num_blocks,
    int64_t block_size, int64_t dim, int64_t max_blocks, float scale,
    int64_t window, float softcap, int io_is_bf16, int cache_kind, int threads, int pooled)
{
    const size_t io_element = io_is_bf16 ? 2 : 4;
    const size_t element = cache_element(cache_kind);
    const int64_t head_size = num_blocks * block_size * dim;
    for (int64_t t = 0; t < batch; t++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            const size_t cache_at = (size_t)(h * head_size + slots[t] * dim) * element;
            store_row((char*)key_cache + cache_at,
                      (const char*)keys + (size_t)(h * k_head_stride + t * k_token_stride) * io_element,
                      dim, io_is_bf16, cache_kind);
            store_row((char*)value_cache + cache_at,
                      (const char*)values + (size_t)(h * v_head_stride + t * v_token_stride) * io_element,
                      dim, io_is_bf16, cache_kind);
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
            if (io_is_bf16) {
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
                                      softcap, cache_kind, threads)
        : triollm_paged_decode(flat_query, key_cache, value_cache, tables, context_lens,
                               flat_out, batch, q_heads, kv_heads, num_blocks, block_size,
                               dim, max_blocks, scale, window, softcap, cache_kind,
                               threads);
    for (int64_t t = 0; t < batch && !failed; t++) {
        for (int64_t h = 0; h < q_heads; h++) {
            const float* row = flat_out + (t * q_heads + h) * dim;
            const int64_t at = h * out_head_stride + t * out_token_stride;
            if (io_is_bf16) {
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
    int64_t window, float softcap, int io_is_bf16, int cache_kind
#define DECODE_STEP_ARGUMENTS                                                           \
    query, q_head_stride, q_token_stride, keys, k_head_stride, k_token_stride,          \
    values, v_head_stride, v_token_stride, out, out_head_stride, out_token_stride,      \
    slots, key_cache, value_cache, tables, context_lens, batch, q_heads, kv_heads,      \
    num_blocks, block_size, dim, max_blocks, scale, window, softcap, io_is_bf16, cache_kind

int triollm_decode_step(DECODE_STEP_PARAMETERS, int threads) {
    return decode_step(DECODE_STEP_ARGUMENTS, threads, 0);
}

int triollm_decode_step_pooled(DECODE_STEP_PARAMETERS, int helpers) {
    return decode_step(DECODE_STEP_ARGUMENTS, helpers, 1);
}
