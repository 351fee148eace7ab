/* triollm::kernel_linear: a compiled model's call of a linear layer on one of the C
   kernels (the quantized int4/int8 products), as a C++ torch op on torch's stable ABI,
   so that a call costs the dispatcher's couple of microseconds rather than a Python
   function's and ctypes' (model/cpu/kernel_ops.py tells the design).

   A layer is registered under its handle with its packed tensors (the registry holds a
   reference until the layer is unregistered) and the C functions that multiply by them,
   passed as addresses from the kernel libraries ctypes loaded. */

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

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
    int (*spare)(void) = spare_threads.load(std::memory_order_relaxed);
    const int helpers = spare != nullptr ? spare() : 0;
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

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(triollm, m) {
    m.def("kernel_linear(Tensor x, int handle, int out_features) -> Tensor");
    m.def("register_kernel_linear(int handle, Tensor weight, Tensor scales, Tensor? bias, "
          "int in_features, int out_features, int group_size, int product, int pooled, "
          "int tiles, int tiles_from) -> ()");
    m.def("unregister_kernel_linear(int handle) -> ()");
    m.def("kernel_linear_count() -> int");
    m.def("set_kernel_pool(int spare_threads) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(triollm, CPU, m) {
    m.impl("kernel_linear", TORCH_BOX(&kernel_linear));
}

STABLE_TORCH_LIBRARY_IMPL(triollm, CompositeExplicitAutograd, m) {
    m.impl("register_kernel_linear", TORCH_BOX(&register_kernel_linear));
    m.impl("unregister_kernel_linear", TORCH_BOX(&unregister_kernel_linear));
    m.impl("kernel_linear_count", TORCH_BOX(&kernel_linear_count));
    m.impl("set_kernel_pool", TORCH_BOX(&set_kernel_pool));
}
