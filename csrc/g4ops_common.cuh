// g4ops_common.cuh: the one dtype-dispatch header and the device helpers every g4ops kernel file shares.
//
// Semantics: nothing here launches anything. It maps ATen dtypes to CUDA's native element types (torch builds
// extensions with __CUDA_NO_HALF_CONVERSIONS__ / __CUDA_NO_BFLOAT16_CONVERSIONS__, so all conversions below are
// explicit intrinsics, round-to-nearest-even like c10's casts), gives 16-byte vector loads, warp reductions, a
// row indexer that turns a row number of a strided tensor (last dim contiguous) into an element offset, and (last
// section) the row-norm building blocks that rms_norm.cu and sandwich_norm.cu share.
// Valid C++17 (the GPU image's torch 2.11 builds with its default standard) and C++20 (torch 2.14 headers).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace g4ops {

// ---------------------------------------------------------------------------------------------------------------
// Input checks. G4OPS_CHECK is TORCH_CHECK that throws the c10::Error at the call site (C10_THROW_ERROR, as
// TORCH_CHECK_TYPE does) instead of through c10::detail::torchCheckFail. On the H200 image (torch 2.11, nvcc 13.0)
// a failed TORCH_CHECK inside these nvcc-compiled launchers crashed the process (SIGSEGV, 2026-11-29), and so does a
// failed G4OPS_CHECK (2026-12-04: softcap_xent_rows with non-contiguous logits, alone in a six-line script), while
// TORCH_CHECK_TYPE failures raise TypeError normally; the cause is not established. So every argument a user or
// g4ops can get wrong is checked in Python before the op (g4ops/ops/core.py, g4ops/ops/loss.py's
// softcap_xent_rows), and these checks only guard the pointer arithmetic.
#define G4OPS_CHECK(cond, ...) TORCH_CHECK_WITH(Error, cond, __VA_ARGS__)

// ---------------------------------------------------------------------------------------------------------------
// dtype dispatch. The body is a lambda; inside it `scalar_t` is the native CUDA element type.

#define G4OPS_DISPATCH_CASE(ENUM, TYPE, ...) \
  case ENUM: {                               \
    using scalar_t = TYPE;                   \
    __VA_ARGS__();                           \
    break;                                   \
  }

// float16, bfloat16, float32 (the kernels' dtypes; float64 takes the ATen path in each op).
#define G4OPS_DISPATCH_HALF_BF16_FLOAT(DTYPE, NAME, ...)                                               \
  [&] {                                                                                                \
    switch (DTYPE) {                                                                                   \
      G4OPS_DISPATCH_CASE(at::ScalarType::Half, __half, __VA_ARGS__)                                   \
      G4OPS_DISPATCH_CASE(at::ScalarType::BFloat16, __nv_bfloat16, __VA_ARGS__)                        \
      G4OPS_DISPATCH_CASE(at::ScalarType::Float, float, __VA_ARGS__)                                   \
      default:                                                                                         \
        G4OPS_CHECK(false, NAME, ": no CUDA kernel for dtype ", DTYPE);                                \
    }                                                                                                  \
  }()

// ... plus float64 (elementwise kernels, whose math is in the accumulation type).
#define G4OPS_DISPATCH_FLOATING(DTYPE, NAME, ...)                                                      \
  [&] {                                                                                                \
    switch (DTYPE) {                                                                                   \
      G4OPS_DISPATCH_CASE(at::ScalarType::Half, __half, __VA_ARGS__)                                   \
      G4OPS_DISPATCH_CASE(at::ScalarType::BFloat16, __nv_bfloat16, __VA_ARGS__)                        \
      G4OPS_DISPATCH_CASE(at::ScalarType::Float, float, __VA_ARGS__)                                   \
      G4OPS_DISPATCH_CASE(at::ScalarType::Double, double, __VA_ARGS__)                                 \
      default:                                                                                         \
        G4OPS_CHECK(false, NAME, ": no CUDA kernel for dtype ", DTYPE);                                \
    }                                                                                                  \
  }()

// float16 and bfloat16 only (the decode GEMV).
#define G4OPS_DISPATCH_HALF_BF16(DTYPE, NAME, ...)                                                     \
  [&] {                                                                                                \
    switch (DTYPE) {                                                                                   \
      G4OPS_DISPATCH_CASE(at::ScalarType::Half, __half, __VA_ARGS__)                                   \
      G4OPS_DISPATCH_CASE(at::ScalarType::BFloat16, __nv_bfloat16, __VA_ARGS__)                        \
      default:                                                                                         \
        G4OPS_CHECK(false, NAME, ": no CUDA kernel for dtype ", DTYPE);                                \
    }                                                                                                  \
  }()

// ---------------------------------------------------------------------------------------------------------------
// Element conversions (explicit intrinsics; RNE on the way down).

template <typename T> struct AccType { using type = float; };
template <> struct AccType<double> { using type = double; };

__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(float v) { return v; }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }

// Accumulation-type conversions (float for 16/32-bit types, double for double).
template <typename A> __device__ __forceinline__ A to_acc(__half v) { return A(__half2float(v)); }
template <typename A> __device__ __forceinline__ A to_acc(__nv_bfloat16 v) { return A(__bfloat162float(v)); }
template <typename A> __device__ __forceinline__ A to_acc(float v) { return A(v); }
template <typename A> __device__ __forceinline__ A to_acc(double v) { return A(v); }

template <typename T, typename A> __device__ __forceinline__ T from_acc(A v) { return from_float<T>(v); }
template <> __device__ __forceinline__ double from_acc<double, double>(double v) { return v; }

// ---------------------------------------------------------------------------------------------------------------
// Vectors: N elements of T, aligned to their size (16 bytes for the widths the kernels pick).

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}

// 16-byte load of data read exactly once (weights in the GEMV): keep it out of L1 so the activations stay there.
__device__ __forceinline__ uint4 load_stream16(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

// 8 packed 16-bit values -> 8 floats.
__device__ __forceinline__ void unpack8(const uint4& r, float (&f)[8], __nv_bfloat16) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&r);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}
__device__ __forceinline__ void unpack8(const uint4& r, float (&f)[8], __half) {
  const __half2* h = reinterpret_cast<const __half2*>(&r);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 t = __half22float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Reductions.

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float2 warp_sum(float2 v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v.x += __shfl_xor_sync(0xffffffffu, v.x, o);
    v.y += __shfl_xor_sync(0xffffffffu, v.y, o);
  }
  return v;
}

// ---------------------------------------------------------------------------------------------------------------
// Row indexer: the leading dims of a tensor whose last dim is contiguous, coalesced to at most kMaxRowDims dims.
// offset(row) is the element offset of the row-major `row`-th row. A q/k-norm view [B, S, H, D] with any strides
// needs at most 3 leading dims.

constexpr int kMaxRowDims = 4;

struct RowIndexer {
  int ndim;                    // number of leading dims after coalescing (0 means a single row)
  int64_t size[kMaxRowDims];   // innermost last
  int64_t stride[kMaxRowDims]; // in elements

  __device__ __forceinline__ int64_t offset(int64_t row) const {
    if (ndim == 1) return row * stride[0];
    int64_t off = 0;
#pragma unroll
    for (int d = kMaxRowDims - 1; d >= 0; --d) {
      if (d < ndim) {
        off += (row % size[d]) * stride[d];
        row /= size[d];
      }
    }
    return off;
  }
};

// Builds the indexer for `t` (last dim contiguous, checked by the caller). Returns false when more than
// kMaxRowDims leading dims remain after dropping size-1 dims and merging dims that are laid out contiguously;
// the caller then uses t.contiguous().
inline bool make_row_indexer(const at::Tensor& t, RowIndexer& ri) {
  int64_t sizes[64], strides[64];
  int n = 0;
  // outermost -> innermost leading dims, skipping size-1 dims
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    if (t.size(d) == 1) continue;
    sizes[n] = t.size(d);
    strides[n] = t.stride(d);
    ++n;
  }
  // merge from the inside out: dim i-1 folds into dim i when stride[i-1] == size[i] * stride[i]
  int64_t ms[64], mst[64];
  int m = 0;
  for (int i = n - 1; i >= 0; --i) {
    if (m > 0 && strides[i] == ms[m - 1] * mst[m - 1]) {
      ms[m - 1] *= sizes[i];
    } else {
      ms[m] = sizes[i];
      mst[m] = strides[i];
      ++m;
    }
  }
  if (m > kMaxRowDims) return false;
  ri.ndim = m;
  // ms/mst are innermost first; the indexer wants innermost last
  for (int i = 0; i < m; ++i) {
    ri.size[i] = ms[m - 1 - i];
    ri.stride[i] = mst[m - 1 - i];
  }
  for (int i = m; i < kMaxRowDims; ++i) {
    ri.size[i] = 1;
    ri.stride[i] = 0;
  }
  if (m == 0) {  // a single row: offset(0) must be 0 through the ndim == 1 fast path
    ri.ndim = 1;
    ri.size[0] = 1;
    ri.stride[0] = 0;
  }
  return true;
}

// Every leading stride a multiple of `vec` elements (16-byte vector rows stay aligned).
inline bool row_strides_multiple_of(const RowIndexer& ri, int64_t vec) {
  for (int i = 0; i < ri.ndim; ++i)
    if (ri.stride[i] % vec != 0) return false;
  return true;
}

inline bool aligned_to(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

inline int num_sms() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

inline const char* dtype_name(at::ScalarType t) { return c10::toString(t); }

// ---------------------------------------------------------------------------------------------------------------
// Row-norm building blocks shared by rms_norm.cu and sandwich_norm.cu (moved from rms_norm.cu unchanged). They sit
// in an anonymous namespace, as they did there: each kernel file gets its own copy of the kernels and of the
// per-kernel attribute caches, so no kernel instantiation is shared between translation units.
namespace {

constexpr int kMaxThreadsPerRow = 1024;

// inv = (mean_sq + eps)^-1/2 from a row's fp32 sum of squares, correctly rounded to fp32: the mean, the root and
// the division in fp64, one rounding at the end (one fp64 sqrt and division per row; its cost is not measured yet).
// rsqrtf is up to 2 ulp off, and a model's gradients amplify per-row scale errors of that size: on the tiny Gemma-4
// with LoRA, a random +-1 ulp per row in inv moves the adapter gradients' fp64 error by 1.3-2.5x, while the
// correctly rounded inv has 0.43x stock's error (CPU emulation, 2026-12-01); H200 with rsqrtf: 3.2x stock's
// (bench/lora_grad_error.py).
__device__ __forceinline__ float inverse_rms(float sum_sq, float inv_n, float eps) {
  return static_cast<float>(1.0 / sqrt(static_cast<double>(sum_sq) * inv_n + eps));
}

// Sum of NV floats over the blockDim.x threads of one row. With blockDim.x == 32 (warp per row, several rows per
// block) it never touches shared memory or __syncthreads, so warps may leave early independently.
// `buf` holds 32 x NV floats; callers that reduce more than once per block alternate two buffers.
template <int NV>
__device__ __forceinline__ void row_sum(float (&v)[NV], float* buf) {
#pragma unroll
  for (int i = 0; i < NV; ++i) v[i] = warp_sum(v[i]);
  if (blockDim.x == 32) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < NV; ++i) buf[warp * NV + i] = v[i];
  }
  __syncthreads();
  const int nwarps = blockDim.x >> 5;
#pragma unroll
  for (int i = 0; i < NV; ++i) v[i] = 0.f;
  for (int w = 0; w < nwarps; ++w)  // same order in every thread: identical totals
#pragma unroll
    for (int i = 0; i < NV; ++i) v[i] += buf[w * NV + i];
}

// Second pass of the weight gradient: dw[n] = sum_p partial[p, n] in a fixed order. Block (32 columns, 16 slices
// of p); each slice sums a strided subset of p, then slice sums are added in slice order.
template <typename OT>
__global__ void reduce_partials_kernel(const float* __restrict__ partial,  // [P, N]
                                       OT* __restrict__ out,               // [N]
                                       int P, int N) {
  __shared__ float s[16][33];
  const int n = blockIdx.x * 32 + threadIdx.x;
  float acc = 0.f;
  if (n < N)
    for (int p = threadIdx.y; p < P; p += 16) acc += partial[int64_t(p) * N + n];
  s[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && n < N) {
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) t += s[i][threadIdx.x];
    out[n] = from_float<OT>(t);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Launch configuration.

// Largest block the compiled kernel can be launched with (its register count limits it below 1024).
int kernel_max_threads(const void* kernel) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> cache;
  const auto key = std::make_pair(kernel, int(at::cuda::current_device()));
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  cudaFuncAttributes attr;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  cache.emplace(key, attr.maxThreadsPerBlock);
  return attr.maxThreadsPerBlock;
}

// Resident blocks per SM for (kernel, block size, device), queried once and cached: the persistent backward grid
// (and so the partial-sum layout) is a pure function of the device, which keeps the weight gradient deterministic.
int blocks_per_sm(const void* kernel, int threads) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int>, int> cache;
  const int dev = at::cuda::current_device();
  const auto key = std::make_tuple(kernel, threads, dev);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int n = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0));
  cache.emplace(key, n);
  return n;
}

struct RowConfig {
  int vec;     // elements per vector (1 = scalar path)
  int items;   // vectors cached per thread
  int tpr;     // threads per row
  int rpb;     // rows per block
};

// max_items: the largest ITEMS the vector path is instantiated with (the scalar path always uses 8).
// Returns false when the row is too wide for the register-cached kernels.
bool pick_config(int N, int vec, int max_items, RowConfig& cfg) {
  cfg.vec = vec;
  const int nvec = N / vec;
  if (vec == 1) {
    cfg.items = 8;
    const int need = (nvec + 7) / 8;
    if (need > kMaxThreadsPerRow) return false;
    cfg.tpr = std::max(32, (need + 31) / 32 * 32);
  } else if (nvec <= 32 * 4) {  // warp per row: head_dim 256 / 512 norms, small hidden sizes
    cfg.items = nvec <= 32 ? 1 : (nvec <= 64 ? 2 : 4);
    cfg.tpr = 32;
  } else {
    int items = 1;
    while ((nvec + items - 1) / items > kMaxThreadsPerRow) items *= 2;
    if (items > max_items) return false;
    cfg.items = items;
    const int need = (nvec + items - 1) / items;
    cfg.tpr = (need + 31) / 32 * 32;
  }
  cfg.rpb = cfg.tpr == 32 ? 4 : 1;
  return true;
}

at::Tensor inverse_rms_aten(const at::Tensor& x_acc, double eps) {
  return at::pow(x_acc.pow(2).mean(-1, /*keepdim=*/true) + eps, -0.5);
}

// rms_norm before its rounding, in the accumulation dtype (reference._normalized).
at::Tensor normalized_aten(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor x_acc = x.to(acc);
  at::Tensor y = x_acc * inverse_rms_aten(x_acc, eps);
  if (weight.has_value()) y = y * weight->to(acc);
  return y;
}

// reference._rms_norm_backward_acc: (grad_x in the accumulation dtype, grad_w in the weight's dtype or empty).
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_acc_aten(const at::Tensor& dy_in, const at::Tensor& x,
                                                              const std::optional<at::Tensor>& weight, double eps,
                                                              bool weight_grad) {
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor x_acc = x.to(acc);
  const at::Tensor inv = inverse_rms_aten(x_acc, eps);
  const at::Tensor x_hat = x_acc * inv;
  const at::Tensor dy = dy_in.to(acc);
  const at::Tensor dy_w = weight.has_value() ? dy * weight->to(acc) : dy;
  const at::Tensor grad_x = inv * (dy_w - x_hat * (dy_w * x_hat).mean(-1, /*keepdim=*/true));
  at::Tensor grad_w;
  if (weight.has_value() && weight_grad) {
    grad_w = (dy * x_hat).reshape({-1, x.size(-1)}).sum(0).to(weight->scalar_type());
  } else {
    grad_w = at::empty({0}, x.options());
  }
  return {grad_x, grad_w};
}

// Prepares a row operand: last dim contiguous and at most kMaxRowDims coalesced leading dims, else contiguous().
at::Tensor rows_operand(const at::Tensor& t, RowIndexer& ri) {
  if (t.stride(-1) == 1 || t.size(-1) == 1) {
    if (make_row_indexer(t, ri)) return t;
  }
  at::Tensor c = t.contiguous();
  TORCH_INTERNAL_ASSERT(make_row_indexer(c, ri));
  return c;
}

// Kernel weight: nullptr, the weight itself (x's dtype or fp32), or a fp32 copy for any other dtype.
at::Tensor kernel_weight(const std::optional<at::Tensor>& weight, at::ScalarType xdt) {
  if (!weight.has_value()) return at::Tensor();
  at::Tensor w = weight->contiguous();
  if (w.scalar_type() != xdt && w.scalar_type() != at::kFloat) w = w.to(at::kFloat);
  return w;
}

}  // namespace

}  // namespace g4ops
