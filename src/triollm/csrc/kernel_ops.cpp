/* C++ torch ops over triollm's C kernels, on torch's stable ABI, so that a compiled
   model's call costs the dispatcher's couple of microseconds rather than a Python
   function's and ctypes' (model/cpu/kernel_ops.py tells the design):

   - triollm::kernel_linear: a linear layer on one of the quantized int4/int8 products.
     A layer is registered under its handle with its packed tensors (the registry holds
     a reference until the layer is unregistered) and the C functions that multiply by
     them, passed as addresses from the kernel libraries ctypes loaded.
   - triollm::decode_attention: triollm::paged_attention's call, run by the C decode
     kernel's one-call step (csrc/decode.c) when the calling thread is inside a step of
     decodes begun with begin_decode_step, else handed to triollm::paged_attention. */

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

using torch::stable::Tensor;

namespace {

/* y[m, n] = x[m, k] @ W^T in bf16; gsize: int4's group size, 0 for int8; last argument:
   OpenMP threads (product) or pool helpers (pooled). Returns 0 where memory ran out. */
using Product = int (*)(const uint16_t*, const void*, const void*, uint16_t*, int64_t,
                        int64_t, int64_t, int64_t, int);
/* The same on AMX tiles, with `panels` of 32 k bf16 per thread. */
using Tiles = void (*)(const uint16_t*, const void*, const void*, uint16_t*, uint16_t*,
                       int64_t, int64_t, int64_t, int64_t, int);

struct Layer {
    Tensor weight;
    Tensor scales;
    std::optional<Tensor> bias;
    int64_t in_features;
    int64_t out_features;
    int64_t group_size;
    Product product;
    Product pooled;
    Tiles tiles;          /* null: never */
    int64_t tiles_from;   /* rows from which `tiles` runs */
};

std::mutex registry_lock;
std::unordered_map<int64_t, std::shared_ptr<const Layer>> registry;

/* The helper pool's triollm_pool_spare_threads: the pool helpers the calling thread's
   kernels may use (0: OpenMP), as helpers.py's set_spare_threads said on that thread. */
std::atomic<int (*)(void)> spare_threads{nullptr};

/* The pool helpers the calling thread's kernels may use (0: OpenMP). */
int pool_helpers() {
    int (*spare)(void) = spare_threads.load(std::memory_order_relaxed);
    return spare != nullptr ? spare() : 0;
}
/* This thread's AMX panels (cache-line aligned, as the tiles' rows are read), kept for
   its next call. */
struct Panels {
    uint16_t* data = nullptr;
    size_t size = 0;
    ~Panels() { std::free(data); }
    uint16_t* at_least(size_t wanted) {
        if (wanted > size) {
            std::free(data);
            size = (wanted + 31) / 32 * 32;
            data = static_cast<uint16_t*>(std::aligned_alloc(64, size * sizeof(uint16_t)));
            if (data == nullptr) size = 0;
        }
        return data;
    }
};
thread_local Panels panels;

std::shared_ptr<const Layer> find(int64_t handle) {
    std::lock_guard<std::mutex> guard(registry_lock);
    auto found = registry.find(handle);
    STD_TORCH_CHECK(found != registry.end(), "triollm::kernel_linear: no layer ", handle);
    return found->second;
}

/* Rounded to nearest even, NaN as 0x7fc0: as torch writes a float as bf16. Branch-free,
   so that the bias loop vectorizes. */
uint16_t to_bf16(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

float from_bf16(uint16_t value) {
    uint32_t bits = (uint32_t)value << 16;
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
}

void add_bias(uint16_t* y, const uint16_t* bias, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < n; j++)
            y[r * n + j] = to_bf16(from_bf16(y[r * n + j]) + from_bf16(bias[j]));
}

Tensor kernel_linear(Tensor x, int64_t handle, int64_t out_features) {
    std::shared_ptr<const Layer> layer = find(handle);
    STD_TORCH_CHECK(x.scalar_type() == torch::headeronly::ScalarType::BFloat16,
                    "triollm::kernel_linear takes bf16 inputs");
    STD_TORCH_CHECK(out_features == layer->out_features && x.dim() >= 1
                    && x.size(x.dim() - 1) == layer->in_features,
                    "triollm::kernel_linear: shapes do not match layer ", handle);
    if (!x.is_contiguous()) x = torch::stable::contiguous(x);
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = out_features;
    Tensor out = torch::stable::new_empty(x, shape);
    const int64_t k = layer->in_features;
    const int64_t rows = k ? x.numel() / k : 0;
    if (rows == 0) return out;
    const auto* in = static_cast<const uint16_t*>(x.data_ptr());
    auto* y = static_cast<uint16_t*>(out.data_ptr());
    const void* w = layer->weight.data_ptr();
    const void* s = layer->scales.data_ptr();
    const int threads = (int)torch::stable::get_num_threads();
    const int helpers = pool_helpers();
    int done = 1;
    if (helpers) {
        done = layer->pooled(in, w, s, y, rows, out_features, k, layer->group_size, helpers);
    } else if (layer->tiles != nullptr && rows >= layer->tiles_from) {
        uint16_t* own = panels.at_least((size_t)threads * 32 * (size_t)k);
        STD_TORCH_CHECK(own != nullptr, "triollm::kernel_linear: no memory for AMX panels");
        layer->tiles(in, w, s, y, own, rows, out_features, k, layer->group_size, threads);
    } else {
        done = layer->product(in, w, s, y, rows, out_features, k, layer->group_size,
                              threads);
    }
    STD_TORCH_CHECK(done, "triollm::kernel_linear: no memory for the kernel's scratch");
    if (layer->bias.has_value())
        add_bias(y, static_cast<const uint16_t*>(layer->bias->data_ptr()), rows,
                 out_features);
    return out;
}

void register_kernel_linear(int64_t handle, Tensor weight, Tensor scales,
                            std::optional<Tensor> bias, int64_t in_features,
                            int64_t out_features, int64_t group_size, int64_t product,
                            int64_t pooled, int64_t tiles, int64_t tiles_from) {
    using torch::headeronly::ScalarType;
    const int64_t n = out_features, k = in_features;
    STD_TORCH_CHECK(n > 0 && n % 16 == 0 && k > 0 && k % 8 == 0 && group_size >= 0
                    && product != 0 && pooled != 0 && (tiles == 0 || tiles_from > 0),
                    "triollm::register_kernel_linear: out_features must be a multiple of "
                    "16, in_features of 8, and the products given");
    STD_TORCH_CHECK(weight.is_cpu() && scales.is_cpu() && weight.is_contiguous()
                    && scales.is_contiguous(),
                    "triollm::register_kernel_linear: packed tensors must be contiguous, "
                    "on the CPU");
    if (group_size > 0) {  /* int4: words of 8 nibbles; a scale and a zero term per group */
        STD_TORCH_CHECK(group_size % 8 == 0 && k % group_size == 0
                        && weight.scalar_type() == ScalarType::Int
                        && weight.numel() == n * k / 8
                        && scales.scalar_type() == ScalarType::Half
                        && scales.numel() == n * (k / group_size) * 2,
                        "triollm::register_kernel_linear: not an int4 layout of ", n, "x", k,
                        " in groups of ", group_size);
    } else {  /* int8: signed bytes, a fp32 scale per output */
        STD_TORCH_CHECK(weight.scalar_type() == ScalarType::Char && weight.numel() == n * k
                        && scales.scalar_type() == ScalarType::Float && scales.numel() == n,
                        "triollm::register_kernel_linear: not an int8 layout of ", n, "x", k);
    }
    if (bias.has_value()) {
        STD_TORCH_CHECK(bias->is_cpu() && bias->is_contiguous() && bias->numel() == n
                        && bias->scalar_type() == torch::headeronly::ScalarType::BFloat16,
                        "triollm::register_kernel_linear: a bias is out_features bf16");
    }
    auto layer = std::make_shared<const Layer>(Layer{
        weight, scales, bias, in_features, out_features, group_size,
        reinterpret_cast<Product>(product), reinterpret_cast<Product>(pooled),
        reinterpret_cast<Tiles>(tiles), tiles_from});
    std::lock_guard<std::mutex> guard(registry_lock);
    registry[handle] = std::move(layer);
}

void unregister_kernel_linear(int64_t handle) {
    std::lock_guard<std::mutex> guard(registry_lock);
    registry.erase(handle);
}

int64_t kernel_linear_count() {
    std::lock_guard<std::mutex> guard(registry_lock);
    return (int64_t)registry.size();
}

void set_kernel_pool(int64_t spare) {
    STD_TORCH_CHECK(spare != 0, "triollm::set_kernel_pool: no function given");
    spare_threads.store(reinterpret_cast<int (*)(void)>(spare));
}


/* triollm_decode_step (csrc/decode.c): the step's keys and values written into a layer's
   caches at their slots, then its queries over their sequences; last argument: OpenMP
   threads (plain) or pool helpers (pooled). Returns nonzero where memory ran out. */
using DecodeStep = int (*)(const void*, int64_t, int64_t, const void*, int64_t, int64_t,
                           const void*, int64_t, int64_t, void*, int64_t, int64_t,
                           const int64_t*, void*, void*, const int64_t*, const int64_t*,
                           int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           float, int64_t, float, int, int, int);

/* A step of decodes only, as begin_decode_step gave it: every layer's caches, the
   step's slots, block tables and context lengths, and the kernel's entry points. */
struct DecodeStepState {
    std::vector<Tensor> keys;
    std::vector<Tensor> values;
    Tensor slots;
    Tensor tables;
    Tensor lengths;
    DecodeStep plain;
    DecodeStep pooled;
};
thread_local std::unique_ptr<DecodeStepState> decode_step_state;

/* The C kernel's code for a cache element type, or -1 for one it does not read. */
int cache_kind(torch::headeronly::ScalarType type) {
    using torch::headeronly::ScalarType;
    switch (type) {
    case ScalarType::Float: return 0;
    case ScalarType::BFloat16: return 1;
    case ScalarType::Float8_e5m2: return 2;
    case ScalarType::Float8_e4m3fn: return 3;
    default: return -1;
    }
}

bool int64_vector(const Tensor& t) {
    return t.is_cpu() && t.dim() >= 1 && t.is_contiguous()
           && t.scalar_type() == torch::headeronly::ScalarType::Long;
}

/* Whether the calls of this thread's step run on the decode kernel from now until
   end_decode_step: not where the step's tensors are not laid out as it reads them. */
bool begin_decode_step(std::vector<Tensor> keys, std::vector<Tensor> values, Tensor slots,
                       Tensor tables, Tensor lengths, int64_t plain, int64_t pooled) {
    STD_TORCH_CHECK(plain != 0 && pooled != 0,
                    "triollm::begin_decode_step: the kernel's entry points are missing");
    decode_step_state.reset();
    if (keys.size() != values.size() || !int64_vector(slots) || !int64_vector(tables)
        || !int64_vector(lengths) || tables.dim() != 2 || slots.numel() != tables.size(0)
        || lengths.numel() != tables.size(0))
        return false;
    for (size_t i = 0; i < keys.size(); i++) {
        const Tensor& k = keys[i];
        const Tensor& v = values[i];
        if (!(k.is_cpu() && v.is_cpu() && k.is_contiguous() && v.is_contiguous()
              && k.dim() == 4 && v.dim() == 4 && cache_kind(k.scalar_type()) >= 0
              && v.scalar_type() == k.scalar_type()
              && std::equal(k.sizes().begin(), k.sizes().end(), v.sizes().begin())))
            return false;
    }
    decode_step_state = std::make_unique<DecodeStepState>(DecodeStepState{
        std::move(keys), std::move(values), std::move(slots), std::move(tables),
        std::move(lengths), reinterpret_cast<DecodeStep>(plain),
        reinterpret_cast<DecodeStep>(pooled)});
    return true;
}

void end_decode_step() { decode_step_state.reset(); }

/* Whether the step's kernel takes this call (else triollm::paged_attention does):
   queries [Hq, rows, D] and keys and values [Hkv, rows, D] in fp32 or bf16 with a
   contiguous last dimension, over caches of the same type or of 8 bits. */
bool step_takes(const DecodeStepState& step, const Tensor& q, const Tensor& k,
                const Tensor& v, int64_t layer) {
    using torch::headeronly::ScalarType;
    if (layer < 0 || layer >= (int64_t)step.keys.size()) return false;
    const Tensor& cache = step.keys[layer];
    const ScalarType type = q.scalar_type();
    if (!(type == ScalarType::Float || type == ScalarType::BFloat16)
        || k.scalar_type() != type || v.scalar_type() != type
        || !(cache.scalar_type() == type || cache.element_size() == 1))
        return false;
    if (q.dim() != 3 || k.dim() != 3 || v.dim() != 3 || !q.is_cpu() || !k.is_cpu()
        || !v.is_cpu() || q.stride(2) != 1 || k.stride(2) != 1 || v.stride(2) != 1)
        return false;
    const int64_t rows = step.tables.size(0), kv_heads = cache.size(0), dim = cache.size(3);
    return q.size(1) == rows && k.size(1) == rows && v.size(1) == rows && q.size(2) == dim
           && k.size(2) == dim && v.size(2) == dim && k.size(0) == kv_heads
           && v.size(0) == kv_heads && q.size(0) % kv_heads == 0 && q.size(0) > 0;
}

Tensor paged_attention_in_python(const Tensor& q, const Tensor& k, const Tensor& v,
                                 int64_t layer, double scale,
                                 std::optional<int64_t> sliding_window,
                                 std::optional<double> softcap) {
    std::array<StableIValue, 7> stack{
        torch::stable::detail::from(q), torch::stable::detail::from(k),
        torch::stable::detail::from(v), torch::stable::detail::from(layer),
        torch::stable::detail::from(scale), torch::stable::detail::from(sliding_window),
        torch::stable::detail::from(softcap)};
    STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher(
        "triollm::paged_attention", "", stack.data(), TORCH_ABI_VERSION));
    return torch::stable::detail::to<Tensor>(stack[0]);
}

Tensor decode_attention(Tensor q, Tensor k, Tensor v, int64_t layer, double scale,
                        std::optional<int64_t> sliding_window,
                        std::optional<double> softcap) {
    const DecodeStepState* step = decode_step_state.get();
    if (step == nullptr || !step_takes(*step, q, k, v, layer))
        return paged_attention_in_python(q, k, v, layer, scale, sliding_window, softcap);
    const Tensor& keys = step->keys[layer];
    const Tensor& values = step->values[layer];
    Tensor out = torch::stable::empty_like(q);  /* q's strides: its last dim contiguous */
    const int helpers = pool_helpers();
    const int bf16 = q.scalar_type() == torch::headeronly::ScalarType::BFloat16;
    const int failed = (helpers ? step->pooled : step->plain)(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
        static_cast<const int64_t*>(step->slots.data_ptr()), keys.data_ptr(),
        values.data_ptr(), static_cast<const int64_t*>(step->tables.data_ptr()),
        static_cast<const int64_t*>(step->lengths.data_ptr()), q.size(1), q.size(0),
        keys.size(0), keys.size(1), keys.size(2), keys.size(3), step->tables.size(1),
        (float)scale, sliding_window.value_or(0), (float)softcap.value_or(0.0), bf16,
        cache_kind(keys.scalar_type()),
        helpers ? helpers : (int)torch::stable::get_num_threads());
    STD_TORCH_CHECK(!failed, "triollm::decode_attention: no memory for the kernel's scratch");
    return out;
}

bool decode_step_begun() { return decode_step_state != nullptr; }

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(triollm, m) {
    m.def("kernel_linear(Tensor x, int handle, int out_features) -> Tensor");
    m.def("register_kernel_linear(int handle, Tensor weight, Tensor scales, Tensor? bias, "
          "int in_features, int out_features, int group_size, int product, int pooled, "
          "int tiles, int tiles_from) -> ()");
    m.def("unregister_kernel_linear(int handle) -> ()");
    m.def("kernel_linear_count() -> int");
    m.def("set_kernel_pool(int spare_threads) -> ()");
    m.def("decode_attention(Tensor query, Tensor key, Tensor value, int layer, float scale, "
          "int? sliding_window, float? softcap) -> Tensor");
    m.def("begin_decode_step(Tensor[] keys, Tensor[] values, Tensor slots, Tensor tables, "
          "Tensor lengths, int plain, int pooled) -> bool");
    m.def("end_decode_step() -> ()");
    m.def("decode_step_begun() -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(triollm, CPU, m) {
    m.impl("kernel_linear", TORCH_BOX(&kernel_linear));
}

STABLE_TORCH_LIBRARY_IMPL(triollm, CompositeExplicitAutograd, m) {
    m.impl("register_kernel_linear", TORCH_BOX(&register_kernel_linear));
    m.impl("unregister_kernel_linear", TORCH_BOX(&unregister_kernel_linear));
    m.impl("kernel_linear_count", TORCH_BOX(&kernel_linear_count));
    m.impl("set_kernel_pool", TORCH_BOX(&set_kernel_pool));
    m.impl("decode_attention", TORCH_BOX(&decode_attention));
    m.impl("begin_decode_step", TORCH_BOX(&begin_decode_step));
    m.impl("end_decode_step", TORCH_BOX(&end_decode_step));
    m.impl("decode_step_begun", TORCH_BOX(&decode_step_begun));
}
