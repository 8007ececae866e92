// adamw.cu: the CUDA kernel of g4ops::adamw_step, one AdamW update of a list of tensors in place.
//
// Semantics (the contract is g4ops/ops/reference.py `adamw_step`): for each tensor i, with t = steps[i] (the step
// number already counted, a float32 scalar on the device), element by element in the accumulation type A (float;
// double for double tensors), with every coefficient rounded once from its double value to A:
//   p -= (lr * weight_decay) * p                   (only when weight_decay != 0)
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g * g
//   p -= (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// and p, m, v are rounded once to their dtype. The bias corrections are computed in double, once per thread.
//
// Why a kernel of our own, and why A and not double: ATen's fused AdamW evaluates the moment updates and the
// weight decay in double (its hyperparameters are doubles). On the H200 that makes the update compute-bound: about
// ten float<->double conversions per element (16 per clock per SM on sm_90) and two IEEE divisions. Measured on
// Gemma-4 E4B's 7.46 B bf16 parameters (2026-11-30): 40.6 ms for ATen's kernel and 40.0 ms for this one with the
// same double arithmetic, both at 61% of the copy bandwidth, against a 24.6 ms floor. In A the arithmetic hides
// under the memory traffic. Accuracy: the moments and the update are A roundings of terms that are then rounded
// to bf16/fp16 (or are fp32 themselves, as in torch's foreach AdamW); tests/test_adamw.py checks the error against
// an fp64 oracle is no larger than torch's fused AdamW's.
//
// Layout: each tensor gets a grid of as many blocks as can be resident, every thread moves 16-byte vectors of all
// four tensors, nothing is read twice. One launch per tensor: the 278 E4B tensors under 10 K elements cost a few
// microseconds each. The four tensors of an entry share shape and strides and are non-overlapping and dense
// (checked in g4ops/ops/core.py), so their elements are the same `numel` consecutive slots from each data pointer.
// 16-byte vectors when all four pointers are 16-byte aligned, element by element otherwise (views at odd offsets);
// 64-bit indices (E4B's per-layer-input table has 2.8 B elements). No host sync, no allocation: a CUDA graph
// captures the call.

#include "g4ops_common.cuh"

#include <torch/library.h>

#include <cmath>

namespace g4ops {
namespace {

constexpr int kThreads = 256;

struct AdamWHyper {
  double lr, beta1, beta2, weight_decay, eps;
};

// The per-element coefficients in A, each rounded once from double; the bias corrections from the step number.
template <typename A>
struct AdamWCoefficients {
  A lr_wd, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias_correction2_sqrt;
  __device__ __forceinline__ AdamWCoefficients(const AdamWHyper& h, float step)
      : lr_wd(h.lr * h.weight_decay),
        beta1(h.beta1),
        one_minus_beta1(1 - h.beta1),
        beta2(h.beta2),
        one_minus_beta2(1 - h.beta2),
        eps(h.eps),
        step_size(h.lr / (1 - ::pow(h.beta1, static_cast<double>(step)))),
        bias_correction2_sqrt(::sqrt(1 - ::pow(h.beta2, static_cast<double>(step)))) {}
};

template <typename A>
__device__ __forceinline__ void adamw_element(A& p, A g, A& m, A& v, const AdamWCoefficients<A>& c) {
  if (c.lr_wd != 0) p -= c.lr_wd * p;
  m = c.beta1 * m + c.one_minus_beta1 * g;
  v = c.beta2 * v + c.one_minus_beta2 * g * g;
  const A denom = std::sqrt(v) / c.bias_correction2_sqrt + c.eps;
  p -= c.step_size * m / denom;
}

template <typename T>
__device__ __forceinline__ void adamw_at(T* p, const T* g, T* m, T* v, int64_t i,
                                         const AdamWCoefficients<typename AccType<T>::type>& c) {
  using A = typename AccType<T>::type;
  A pa = to_acc<A>(p[i]), ma = to_acc<A>(m[i]), va = to_acc<A>(v[i]);
  adamw_element<A>(pa, to_acc<A>(g[i]), ma, va, c);
  p[i] = from_acc<T, A>(pa);
  m[i] = from_acc<T, A>(ma);
  v[i] = from_acc<T, A>(va);
}

// kVec elements per thread and iteration (16 bytes), grid-stride; kVec == 1 is the unaligned path. The last
// n % kVec elements go one per thread to the first threads of the grid.
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads) adamw_kernel(T* __restrict__ p, const T* __restrict__ g,
                                                         T* __restrict__ m, T* __restrict__ v,
                                                         const float* __restrict__ step, int64_t n, AdamWHyper h) {
  using A = typename AccType<T>::type;
  const AdamWCoefficients<A> c(h, *step);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t vectors = n / kVec;
  for (int64_t j = tid; j < vectors; j += stride) {
    const int64_t i = j * kVec;
    Vec<T, kVec> pv = load_vec<T, kVec>(p + i), gv = load_vec<T, kVec>(g + i);
    Vec<T, kVec> mv = load_vec<T, kVec>(m + i), vv = load_vec<T, kVec>(v + i);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      A pa = to_acc<A>(pv.v[k]), ma = to_acc<A>(mv.v[k]), va = to_acc<A>(vv.v[k]);
      adamw_element<A>(pa, to_acc<A>(gv.v[k]), ma, va, c);
      pv.v[k] = from_acc<T, A>(pa);
      mv.v[k] = from_acc<T, A>(ma);
      vv.v[k] = from_acc<T, A>(va);
    }
    store_vec<T, kVec>(p + i, pv);
    store_vec<T, kVec>(m + i, mv);
    store_vec<T, kVec>(v + i, vv);
  }
  const int64_t tail = vectors * kVec + tid;
  if (tail < n) adamw_at<T>(p, g, m, v, tail, c);
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// As many blocks as can be resident at once (the bf16 kernel's 64 registers allow 4 blocks of 256 threads per SM on
// sm_90), fewer for small tensors; the grid-stride loop covers the rest.
template <typename T, int kVec>
void launch_adamw_kernel(T* p, const T* g, T* m, T* v, const float* step, int64_t n, const AdamWHyper& h,
                         int sm_count, cudaStream_t stream) {
  static const int resident = [] {
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, adamw_kernel<T, kVec>, kThreads, 0));
    return std::max(per_sm, 1);
  }();
  const int64_t work = kVec == 1 ? n : std::max<int64_t>(n / kVec, n % kVec);
  const int64_t blocks = std::min<int64_t>((work + kThreads - 1) / kThreads, int64_t(sm_count) * resident);
  adamw_kernel<T, kVec><<<blocks, kThreads, 0, stream>>>(p, g, m, v, step, n, h);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_adamw(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                  const at::Tensor& exp_avg_sq, const at::Tensor& step, const AdamWHyper& h, int sm_count,
                  cudaStream_t stream) {
  T* p = reinterpret_cast<T*>(param.data_ptr());
  const T* g = reinterpret_cast<const T*>(grad.data_ptr());
  T* m = reinterpret_cast<T*>(exp_avg.data_ptr());
  T* v = reinterpret_cast<T*>(exp_avg_sq.data_ptr());
  const float* t = step.data_ptr<float>();
  if (aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v)) {
    launch_adamw_kernel<T, 16 / sizeof(T)>(p, g, m, v, t, param.numel(), h, sm_count, stream);
  } else {
    launch_adamw_kernel<T, 1>(p, g, m, v, t, param.numel(), h, sm_count, stream);
  }
}

void adamw_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList steps, double lr, double beta1, double beta2,
                     double weight_decay, double eps) {
  // Shapes, strides, dtypes and devices were checked in g4ops/ops/core.py; these guard the pointer arithmetic only.
  const size_t count = params.size();
  G4OPS_CHECK(grads.size() == count && exp_avgs.size() == count && exp_avg_sqs.size() == count &&
                  steps.size() == count,
              "g4ops.adamw_step: the five tensor lists must have the same length");
  const AdamWHyper h{lr, beta1, beta2, weight_decay, eps};
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& param = params[i];
    if (param.numel() == 0) continue;
    G4OPS_CHECK(grads[i].numel() == param.numel() && exp_avgs[i].numel() == param.numel() &&
                    exp_avg_sqs[i].numel() == param.numel() && steps[i].scalar_type() == at::kFloat,
                "g4ops.adamw_step: entry ", i, " does not match its parameter");
    const c10::cuda::CUDAGuard guard(param.device());
    const int sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    G4OPS_DISPATCH_FLOATING(param.scalar_type(), "g4ops.adamw_step", [&] {
      launch_adamw<scalar_t>(param, grads[i], exp_avgs[i], exp_avg_sqs[i], steps[i], h, sm_count, stream);
    });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(g4ops, CUDA, m) {
  m.impl("adamw_step", &adamw_step_cuda);
}

}  // namespace g4ops
