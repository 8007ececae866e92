// rms_norm.cu: CUDA kernels for g4ops::rms_norm and g4ops::rms_norm_backward.
//
// Semantics (the contract is g4ops/ops/reference.py; design.md section 4):
//   forward   y[r, :] = cast( (x32[r, :] * inv_r) * w32 ),  inv_r = (sum_k x32[r, k]^2 * (1/N) + eps)^-1/2
//             (fp32 math, one rounding to x.dtype; no weight -> no multiply; inv_r correctly rounded through fp64,
//             inverse_rms in g4ops_common.cuh, where torch's CUDA pow(t, -0.5) is rsqrtf, up to 2 ulp off: so this
//             matches ops/reference.py run on CUDA up to summation order and that 2 ulp).
//   backward  dyw = dy32 * w32 (or dy32), xhat = x32 * inv_r, m_r = inv_r * sum_k(dyw * x32) * (1/N)
//             dx = cast( inv_r * (dyw - xhat * m_r) )
//             dw = cast_to_weight_dtype( sum_r dy32 * xhat ), reduced in fp32 deterministically: every CTA owns a
//             fixed set of rows (grid-stride) and writes its column partials to a [P, N] fp32 buffer; a second
//             kernel sums the P partials per column in a fixed order. No atomics: two runs are bitwise equal.
// Outputs are fresh contiguous tensors; every element of y / dx / dw is assigned (never accumulated into).
// x and grad_out may be strided: rows are addressed through a RowIndexer when the last dim is contiguous, else
// the tensor is made contiguous first. float64 (gradcheck) and rows too wide for the register-cached kernels
// (N > 8192 vectors) use the same math through ATen ops.
// Each thread caches its share of the row in registers (ITEMS vectors of VEC elements), so x is read once.
// Shared with sandwich_norm.cu, in g4ops_common.cuh: row_sum, reduce_partials_kernel, the launch configuration
// (pick_config, kernel_max_threads, blocks_per_sm), rows_operand, kernel_weight, inverse_rms_aten.

#include "g4ops_common.cuh"

#include <torch/library.h>

#include <map>
#include <mutex>
#include <tuple>

namespace g4ops {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Forward. Block = (tpr threads per row, rpb rows); rpb > 1 only when tpr == 32. Each thread row-group handles RPT
// consecutive rows at once (RPT = 2 on wide rows: twice the bytes in flight and one barrier per two rows).
template <typename T, typename WT, int VEC, int ITEMS, int RPT>
__global__ void rms_norm_fwd_kernel(const T* __restrict__ x,   // [rows, N] addressed through xi
                                    RowIndexer xi,
                                    const WT* __restrict__ w,  // [N] or nullptr
                                    T* __restrict__ y,         // [rows, N] contiguous
                                    int64_t rows, int N, float eps, float inv_n) {
  __shared__ float buf[32 * RPT];
  const int64_t row0 = (int64_t(blockIdx.x) * blockDim.y + threadIdx.y) * RPT;
  if (row0 >= rows) return;  // only with rpb > 1, where there is no block-wide barrier
  const int tid = threadIdx.x, tpr = blockDim.x;
  const int nvec = N / VEC;

  Vec<T, VEC> xv[RPT][ITEMS];
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    if (row0 + r < rows) {
      const T* xr = x + xi.offset(row0 + r);
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int c = i * tpr + tid;
        if (c < nvec) xv[r][i] = load_vec<T, VEC>(xr + int64_t(c) * VEC);
      }
    }
  }
  float ss[RPT];
#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    ss[r] = 0.f;
    if (row0 + r < rows) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int c = i * tpr + tid;
        if (c < nvec) {
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            const float f = to_float(xv[r][i].v[k]);
            ss[r] += f * f;
          }
        }
      }
    }
  }
  row_sum<RPT>(ss, buf);

#pragma unroll
  for (int r = 0; r < RPT; ++r) {
    if (row0 + r >= rows) continue;
    const float inv = inverse_rms(ss[r], inv_n, eps);
    T* yr = y + (row0 + r) * N;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c = i * tpr + tid;
      if (c < nvec) {
        Vec<T, VEC> out;
        if (w != nullptr) {
          const Vec<WT, VEC> wv = load_vec<WT, VEC>(w + int64_t(c) * VEC);
#pragma unroll
          for (int k = 0; k < VEC; ++k)
            out.v[k] = from_float<T>((to_float(xv[r][i].v[k]) * inv) * to_float(wv.v[k]));
        } else {
#pragma unroll
          for (int k = 0; k < VEC; ++k) out.v[k] = from_float<T>(to_float(xv[r][i].v[k]) * inv);
        }
        store_vec<T, VEC>(yr + int64_t(c) * VEC, out);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Backward. WITH_DW (a weight gradient wanted): persistent over rows (grid-stride by row groups of rpb * RPT rows) so
// that each CTA's weight-gradient partial covers a fixed, deterministic set of rows. Without (a frozen or absent
// weight, as under LoRA): one group per CTA, as the forward. The persistent loop and the accumulators cost registers
// (nvcc 13.0, sm_90a, bf16 at 2560 columns: 78 per thread with RPT = 2, 40 without a weight gradient and RPT = 1),
// so 2 CTAs of 320 threads per SM instead of 5, each walking its groups one after another: in session 31's LoRA
// profile (H100) the [2048, 2560] call took 16.7 us against the forward's 6.5
// (bench/results/2026-12-05-h100-session31.md).
// dx must not depend on whether a weight gradient was asked for. The two instantiations are compiled apart, and nvcc
// may contract a * b + c into an FMA in one and not the other, so the roundings are pinned (__fmul_rn / __fmaf_rn;
// sandwich_norm.cu's backward likewise); and launch_bwd sends both kinds of call to the fallback where the
// weight-gradient kernel cannot launch (the cause of session 31's 5125-column mismatch, found in session 32).
template <typename T, typename WT, int VEC, int ITEMS, int RPT, bool WITH_DW>
__global__ void rms_norm_bwd_kernel(const T* __restrict__ dy,          // [rows, N] addressed through di
                                    RowIndexer di,
                                    const T* __restrict__ x,           // [rows, N] addressed through xi
                                    RowIndexer xi,
                                    const WT* __restrict__ w,          // [N] or nullptr
                                    T* __restrict__ dx,                // [rows, N] contiguous
                                    float* __restrict__ dw_partial,    // [gridDim.x * blockDim.y, N] or nullptr
                                    int64_t rows, int N, float eps, float inv_n) {
  __shared__ float buf[2][32 * 2 * RPT];
  const int tid = threadIdx.x, tpr = blockDim.x, rpb = blockDim.y;
  const int nvec = N / VEC;
  const int64_t group_rows = int64_t(rpb) * RPT;
  float wacc[ITEMS][VEC];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i)
#pragma unroll
    for (int k = 0; k < VEC; ++k) wacc[i][k] = 0.f;

  int parity = 0;
  for (int64_t group = blockIdx.x; group * group_rows < rows; group += gridDim.x, parity ^= 1) {
    const int64_t row0 = group * group_rows + int64_t(threadIdx.y) * RPT;
    if (row0 >= rows) {  // only with rpb > 1 (warp-only reductions)
      if (!WITH_DW) return;
      continue;
    }
    Vec<T, VEC> xv[RPT][ITEMS], dv[RPT][ITEMS];
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      if (row0 + r < rows) {
        const T* xr = x + xi.offset(row0 + r);
        const T* dr = dy + di.offset(row0 + r);
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
          const int c = i * tpr + tid;
          if (c < nvec) {
            xv[r][i] = load_vec<T, VEC>(xr + int64_t(c) * VEC);
            dv[r][i] = load_vec<T, VEC>(dr + int64_t(c) * VEC);
          }
        }
      }
    }
    float sums[2 * RPT];  // per row: sum x^2, sum (dy * w) * x
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      sums[2 * r] = 0.f;
      sums[2 * r + 1] = 0.f;
      if (row0 + r < rows) {
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
          const int c = i * tpr + tid;
          if (c < nvec) {
            Vec<WT, VEC> wv;
            if (w != nullptr) wv = load_vec<WT, VEC>(w + int64_t(c) * VEC);
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
              const float xf = to_float(xv[r][i].v[k]);
              const float d = to_float(dv[r][i].v[k]);
              const float g = w != nullptr ? __fmul_rn(d, to_float(wv.v[k])) : d;
              sums[2 * r] = __fmaf_rn(xf, xf, sums[2 * r]);
              sums[2 * r + 1] = __fmaf_rn(g, xf, sums[2 * r + 1]);
            }
          }
        }
      }
    }
    row_sum<2 * RPT>(sums, buf[parity]);

#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      if (row0 + r >= rows) continue;
      const float inv = inverse_rms(sums[2 * r], inv_n, eps);
      const float m = (sums[2 * r + 1] * inv) * inv_n;  // mean(dyw * xhat)
      T* dxr = dx + (row0 + r) * N;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int c = i * tpr + tid;
        if (c < nvec) {
          Vec<WT, VEC> wv;
          if (w != nullptr) wv = load_vec<WT, VEC>(w + int64_t(c) * VEC);
          Vec<T, VEC> out;
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            const float xhat = __fmul_rn(to_float(xv[r][i].v[k]), inv);
            const float d = to_float(dv[r][i].v[k]);
            const float g = w != nullptr ? __fmul_rn(d, to_float(wv.v[k])) : d;
            out.v[k] = from_float<T>(__fmul_rn(inv, __fmaf_rn(-xhat, m, g)));
            if (WITH_DW) wacc[i][k] = __fmaf_rn(d, xhat, wacc[i][k]);
          }
          store_vec<T, VEC>(dxr + int64_t(c) * VEC, out);
        }
      }
    }
    if (!WITH_DW) return;  // one group per CTA: the grid covers every group
  }

  if (dw_partial != nullptr) {
    float* pr = dw_partial + (int64_t(blockIdx.x) * rpb + threadIdx.y) * N;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c = i * tpr + tid;
      if (c < nvec) {
        Vec<float, VEC> o;
#pragma unroll
        for (int k = 0; k < VEC; ++k) o.v[k] = wacc[i][k];
        store_vec<float, VEC>(pr + int64_t(c) * VEC, o);
      }
    }
  }
}

// Vector width for element type T: 16 bytes when every row start, the row length and the weight allow it.
template <typename T, typename WT>
int pick_vec(const at::Tensor& x, const RowIndexer& xi, const at::Tensor* x2, const RowIndexer* xi2,
             const WT* w, int N) {
  constexpr int V = 16 / sizeof(T);
  if (N % V != 0) return 1;
  if (!aligned_to(x.data_ptr(), 16) || !row_strides_multiple_of(xi, V)) return 1;
  if (x2 != nullptr && (!aligned_to(x2->data_ptr(), 16) || !row_strides_multiple_of(*xi2, V))) return 1;
  if (w != nullptr && !aligned_to(w, sizeof(WT) * V)) return 1;
  return V;
}

// ---------------------------------------------------------------------------------------------------------------
// ATen path: float64 and very wide rows. Same expressions as ops/reference.py.

at::Tensor rms_norm_aten(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  return normalized_aten(x, weight, eps).to(x.scalar_type()).contiguous();
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_aten(const at::Tensor& grad_out, const at::Tensor& x,
                                                          const std::optional<at::Tensor>& weight, double eps,
                                                          bool weight_grad) {
  auto [grad_x, grad_w] = rms_norm_backward_acc_aten(grad_out, x, weight, eps, weight_grad);
  return {grad_x.to(x.scalar_type()).contiguous(), grad_w};
}

// ---------------------------------------------------------------------------------------------------------------
// Checks (same wording as ops/core.py).

void check_rms_norm_inputs(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                           double eps) {
  const auto dt = x.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kHalf || dt == at::kBFloat16 || dt == at::kFloat || dt == at::kDouble,
              "g4ops: `x` must be float16, bfloat16, float32 or float64, got ", dt);
  G4OPS_CHECK(x.dim() >= 1, "g4ops.", op, ": `x` must have at least one dimension");
  G4OPS_CHECK(eps >= 0.0, "g4ops.", op, ": `eps` must be >= 0, got ", eps);
  G4OPS_CHECK(x.is_cuda(), "g4ops.", op, ": the CUDA kernel got `x` on ", x.device());
  if (weight.has_value()) {
    const auto& w = *weight;
    const auto wt = w.scalar_type();
    TORCH_CHECK_TYPE(wt == at::kHalf || wt == at::kBFloat16 || wt == at::kFloat || wt == at::kDouble,
                "g4ops: `weight` must be float16, bfloat16, float32 or float64, got ", wt);
    G4OPS_CHECK(w.dim() == 1 && w.size(0) == x.size(-1), "g4ops.", op, ": `weight` must have shape [", x.size(-1),
                "] (the last dim of `x`), got ", w.sizes());
    G4OPS_CHECK(w.device() == x.device(), "g4ops.", op, ": `weight` is on ", w.device(), " but `x` is on ",
                x.device());
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Forward launcher.

template <typename T, typename WT, int VEC, int ITEMS, int RPT = 1>
bool launch_fwd(const RowConfig& cfg, const T* x, const RowIndexer& xi, const WT* w, T* y, int64_t rows, int N,
                float eps, cudaStream_t stream) {
  if (cfg.tpr * cfg.rpb > kernel_max_threads(reinterpret_cast<const void*>(rms_norm_fwd_kernel<T, WT, VEC, ITEMS, RPT>)))
    return false;
  const dim3 block(cfg.tpr, cfg.rpb);
  const int64_t per_block = int64_t(cfg.rpb) * RPT;
  const int64_t grid = (rows + per_block - 1) / per_block;
  rms_norm_fwd_kernel<T, WT, VEC, ITEMS, RPT>
      <<<static_cast<unsigned>(grid), block, 0, stream>>>(x, xi, w, y, rows, N, eps, 1.0f / float(N));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

template <typename T, typename WT>
bool rms_norm_fwd_typed(const at::Tensor& x, const RowIndexer& xi, const at::Tensor& w, at::Tensor& y,
                        int64_t rows, int N, float eps) {
  const WT* wp = w.defined() ? reinterpret_cast<const WT*>(w.data_ptr()) : nullptr;
  const int vec = pick_vec<T, WT>(x, xi, nullptr, nullptr, wp, N);
  RowConfig cfg;
  if (!pick_config(N, vec, 8, cfg)) return false;
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  constexpr int V = 16 / sizeof(T);
  bool launched = false;
  if (cfg.vec == 1) {
    launched = launch_fwd<T, WT, 1, 8>(cfg, xp, xi, wp, yp, rows, N, eps, stream);
  } else {
    switch (cfg.items) {
      // One row per thread: on an H200 (2026-11-29, 16384 x 2560 bf16) RPT = 2 measured 61.9 us against
      // 55.8 us for RPT = 1, so the forward keeps one row per thread (the backward uses RPT = 2).
      case 1: launched = launch_fwd<T, WT, V, 1>(cfg, xp, xi, wp, yp, rows, N, eps, stream); break;
      case 2: launched = launch_fwd<T, WT, V, 2>(cfg, xp, xi, wp, yp, rows, N, eps, stream); break;
      case 4: launched = launch_fwd<T, WT, V, 4>(cfg, xp, xi, wp, yp, rows, N, eps, stream); break;
      default: launched = launch_fwd<T, WT, V, 8>(cfg, xp, xi, wp, yp, rows, N, eps, stream); break;
    }
  }
  return launched;
}

at::Tensor rms_norm_cuda(const at::Tensor& x_in, const std::optional<at::Tensor>& weight, double eps) {
  check_rms_norm_inputs("rms_norm", x_in, weight, eps);
  const c10::cuda::CUDAGuard guard(x_in.device());
  if (x_in.scalar_type() == at::kDouble) return rms_norm_aten(x_in, weight, eps);
  const int64_t N64 = x_in.size(-1);
  at::Tensor y = at::empty(x_in.sizes(), x_in.options().memory_format(at::MemoryFormat::Contiguous));
  if (y.numel() == 0) return y;
  G4OPS_CHECK(N64 <= INT32_MAX, "g4ops.rms_norm: last dim of `x` too large: ", N64);
  const int N = static_cast<int>(N64);
  const int64_t rows = x_in.numel() / N;
  RowIndexer xi;
  const at::Tensor x = rows_operand(x_in, xi);
  const at::Tensor w = kernel_weight(weight, x.scalar_type());
  bool ok = false;
  G4OPS_DISPATCH_HALF_BF16_FLOAT(x.scalar_type(), "g4ops.rms_norm", [&] {
    if (w.defined() && w.scalar_type() == at::kFloat && !std::is_same<scalar_t, float>::value) {
      ok = rms_norm_fwd_typed<scalar_t, float>(x, xi, w, y, rows, N, static_cast<float>(eps));
    } else {
      ok = rms_norm_fwd_typed<scalar_t, scalar_t>(x, xi, w, y, rows, N, static_cast<float>(eps));
    }
  });
  if (!ok) return rms_norm_aten(x_in, weight, eps);  // row wider than the register-cached kernels hold
  return y;
}

// ---------------------------------------------------------------------------------------------------------------
// Backward launcher.

// RPT: rows per thread row-group with a weight gradient; without one a thread takes one row, as in the forward.
template <typename T, typename WT, int VEC, int ITEMS, int RPT = 1>
bool launch_bwd(const RowConfig& cfg, const T* dy, const RowIndexer& di, const T* x, const RowIndexer& xi,
                const WT* w, T* dx, at::Tensor* partial, int64_t rows, int N, float eps, cudaStream_t stream) {
  const dim3 block(cfg.tpr, cfg.rpb);
  const float inv_n = 1.0f / float(N);
  auto kernel = rms_norm_bwd_kernel<T, WT, VEC, ITEMS, RPT, true>;
  // where the weight-gradient kernel cannot launch this block, neither kind of call takes a kernel (see the kernel)
  if (cfg.tpr * cfg.rpb > kernel_max_threads(reinterpret_cast<const void*>(kernel))) return false;
  if (partial == nullptr) {
    auto light = rms_norm_bwd_kernel<T, WT, VEC, ITEMS, 1, false>;
    if (cfg.tpr * cfg.rpb > kernel_max_threads(reinterpret_cast<const void*>(light))) return false;
    const int64_t grid = (rows + cfg.rpb - 1) / cfg.rpb;
    light<<<static_cast<unsigned>(grid), block, 0, stream>>>(dy, di, x, xi, w, dx, nullptr, rows, N, eps, inv_n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return true;
  }
  const int per_sm = blocks_per_sm(reinterpret_cast<const void*>(kernel), cfg.tpr * cfg.rpb);
  const int64_t per_group = int64_t(cfg.rpb) * RPT;
  const int64_t groups = (rows + per_group - 1) / per_group;
  const int grid = static_cast<int>(std::min<int64_t>(groups, int64_t(std::max(per_sm, 1)) * num_sms()));
  *partial = at::empty({int64_t(grid) * cfg.rpb, N}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA));
  float* pp = partial->data_ptr<float>();  // every row is written: warps past `rows` write zeros
  kernel<<<grid, block, 0, stream>>>(dy, di, x, xi, w, dx, pp, rows, N, eps, inv_n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

template <typename T, typename WT>
bool rms_norm_bwd_typed(const at::Tensor& dy, const RowIndexer& di, const at::Tensor& x, const RowIndexer& xi,
                        const at::Tensor& w, at::Tensor& dx, bool want_dw, at::Tensor& partial, int64_t rows, int N,
                        float eps) {
  const WT* wp = w.defined() ? reinterpret_cast<const WT*>(w.data_ptr()) : nullptr;
  const int vec = pick_vec<T, WT>(x, xi, &dy, &di, wp, N);
  RowConfig cfg;
  if (!pick_config(N, vec, 4, cfg)) return false;
  const T* dyp = reinterpret_cast<const T*>(dy.data_ptr());
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  T* dxp = reinterpret_cast<T*>(dx.data_ptr());
  at::Tensor* pp = want_dw ? &partial : nullptr;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  constexpr int V = 16 / sizeof(T);
  bool launched = false;
  if (cfg.vec == 1) {
    launched = launch_bwd<T, WT, 1, 8>(cfg, dyp, di, xp, xi, wp, dxp, pp, rows, N, eps, stream);
  } else {
    switch (cfg.items) {
      case 1:
        launched = cfg.tpr > 32
                       ? launch_bwd<T, WT, V, 1, 2>(cfg, dyp, di, xp, xi, wp, dxp, pp, rows, N, eps, stream)
                       : launch_bwd<T, WT, V, 1>(cfg, dyp, di, xp, xi, wp, dxp, pp, rows, N, eps, stream);
        break;
      case 2: launched = launch_bwd<T, WT, V, 2>(cfg, dyp, di, xp, xi, wp, dxp, pp, rows, N, eps, stream); break;
      default: launched = launch_bwd<T, WT, V, 4>(cfg, dyp, di, xp, xi, wp, dxp, pp, rows, N, eps, stream); break;
    }
  }
  return launched;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cuda(const at::Tensor& grad_out_in, const at::Tensor& x_in,
                                                          const std::optional<at::Tensor>& weight, double eps,
                                                          bool weight_grad) {
  check_rms_norm_inputs("rms_norm_backward", x_in, weight, eps);
  G4OPS_CHECK(grad_out_in.sizes() == x_in.sizes(), "g4ops.rms_norm_backward: `grad_out` must have the shape of `x` ",
              x_in.sizes(), ", got ", grad_out_in.sizes());
  G4OPS_CHECK(grad_out_in.device() == x_in.device(), "g4ops.rms_norm_backward: `grad_out` is on ",
              grad_out_in.device(), " but `x` is on ", x_in.device());
  G4OPS_CHECK(grad_out_in.is_floating_point(), "g4ops.rms_norm_backward: `grad_out` must be floating point, got ",
              grad_out_in.scalar_type());
  const c10::cuda::CUDAGuard guard(x_in.device());
  if (x_in.scalar_type() == at::kDouble) return rms_norm_backward_aten(grad_out_in, x_in, weight, eps, weight_grad);

  const bool want_dw = weight.has_value() && weight_grad;
  at::Tensor dx = at::empty(x_in.sizes(), x_in.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t N64 = x_in.size(-1);
  const int64_t rows = N64 == 0 ? 0 : x_in.numel() / N64;
  if (x_in.numel() == 0) {
    at::Tensor dw = want_dw ? at::zeros(weight->sizes(), weight->options()) : at::empty({0}, x_in.options());
    return {dx, dw};
  }
  G4OPS_CHECK(N64 <= INT32_MAX, "g4ops.rms_norm_backward: last dim of `x` too large: ", N64);
  const int N = static_cast<int>(N64);
  // grad_out from autograd has x's dtype; anything else is rounded to it first
  const at::Tensor go = grad_out_in.scalar_type() == x_in.scalar_type() ? grad_out_in
                                                                          : grad_out_in.to(x_in.scalar_type());
  RowIndexer xi, di;
  const at::Tensor x = rows_operand(x_in, xi);
  const at::Tensor dy = rows_operand(go, di);
  const at::Tensor w = kernel_weight(weight, x.scalar_type());
  at::Tensor partial;
  bool ok = false;
  G4OPS_DISPATCH_HALF_BF16_FLOAT(x.scalar_type(), "g4ops.rms_norm_backward", [&] {
    if (w.defined() && w.scalar_type() == at::kFloat && !std::is_same<scalar_t, float>::value) {
      ok = rms_norm_bwd_typed<scalar_t, float>(dy, di, x, xi, w, dx, want_dw, partial, rows, N,
                                               static_cast<float>(eps));
    } else {
      ok = rms_norm_bwd_typed<scalar_t, scalar_t>(dy, di, x, xi, w, dx, want_dw, partial, rows, N,
                                                  static_cast<float>(eps));
    }
  });
  if (!ok) return rms_norm_backward_aten(grad_out_in, x_in, weight, eps, weight_grad);
  if (!want_dw) return {dx, at::empty({0}, x_in.options())};

  // second pass: column sums of the partials, written in the weight's dtype
  const auto wdt = weight->scalar_type();
  const bool direct = wdt == at::kFloat || wdt == at::kHalf || wdt == at::kBFloat16;
  at::Tensor dw = at::empty({N64}, weight->options().dtype(direct ? wdt : at::kFloat));
  const int P = static_cast<int>(partial.size(0));
  const dim3 block(32, 16);
  const dim3 grid((N + 31) / 32);
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  G4OPS_DISPATCH_HALF_BF16_FLOAT(dw.scalar_type(), "g4ops.rms_norm_backward", [&] {
    reduce_partials_kernel<scalar_t><<<grid, block, 0, stream>>>(
        partial.data_ptr<float>(), reinterpret_cast<scalar_t*>(dw.data_ptr()), P, N);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (!direct) dw = dw.to(wdt);
  return {dx, dw};
}

}  // namespace

TORCH_LIBRARY_IMPL(g4ops, CUDA, m) {
  m.impl("rms_norm", &rms_norm_cuda);
  m.impl("rms_norm_backward", &rms_norm_backward_cuda);
}

}  // namespace g4ops
