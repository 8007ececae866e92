// sandwich_norm.cu: CUDA kernels for g4ops::sandwich_norm and g4ops::sandwich_norm_backward.
//
// Gemma's sandwich: a block's branch output is post-normed and added to the residual stream, and that sum is
// pre-normed for the next block. Fusing the three steps reads each activation once and rounds the sum once.
// Semantics (the contract is g4ops/ops/reference.py `sandwich_norm` / `sandwich_norm_backward`; design.md section 4),
// per row, fp32 math, inv(v) = (sum_k v32_k^2 * (1/N) + eps)^-1/2 correctly rounded (inverse_rms, as in rms_norm.cu:
// ops/reference.py run on CUDA up to summation order and rsqrtf's 2 ulp), no weight -> no multiply:
//   forward   s = cast( res32 + (b32 * inv(b32)) * wpost32 )       one rounding of the sum (stock rounds twice)
//             y = cast( (s32 * inv(s32)) * wpre32 )                of the ROUNDED s: what the next layer reads
//   backward  with gs = grad_sum, gn = grad_normed, b = branch, s = the forward's rounded sum:
//             s_hat = s32 * inv(s32), g2 = gn32 * wpre32, m2 = mean(g2 * s_hat)
//             ds = gs32 + inv(s32) * (g2 - s_hat * m2)              stays fp32 for everything below
//             grad_residual = cast(ds)
//             b_hat = b32 * inv(b32), g1 = ds * wpost32, m1 = mean(g1 * b_hat)
//             grad_branch = cast( inv(b32) * (g1 - b_hat * m1) )
//             grad_pre_weight = sum_r gn32 * s_hat, grad_post_weight = sum_r ds * b_hat, in fp32 and deterministic
//             as in rms_norm.cu: a persistent grid, each CTA row slot writes its column partials to a [P, N] fp32
//             buffer, reduce_partials_kernel sums them in a fixed order. No atomics: two runs are bitwise equal.
//             A weight gradient not asked for, or without a weight, is an empty tensor of branch's dtype.
// Outputs are fresh contiguous tensors; every element is assigned once, nothing is accumulated into.
// Row operands may be strided: RowIndexer when the last dim is contiguous, else a contiguous copy. Weights enter the
// kernels in the activation dtype or fp32 (kernel_weight; when the two weights end up in different types both go
// fp32, which is exact, so one weight type per kernel keeps the instantiation count down).
// Each thread caches its share of a row in registers (ITEMS vectors of VEC elements): every input is read once.
// The same math runs through ATen ops for float64 (gradcheck), for gradients whose dtype differs from branch's (the
// reference reads those in their own dtype; the kernels read T), and for rows too wide for the register-cached
// kernels: from CUDA 13.0's register counts (ptxas, sm_90), the backward kernel holds rows up to 8192 16-bit or
// 6144 fp32 elements (4096 on the scalar path for rows not 16-byte aligned), the forward about 20000 or more.

#include "g4ops_common.cuh"

#include <torch/library.h>

#include <array>
#include <tuple>

namespace g4ops {
namespace {

// Keeps a register-cached vector packed across a row reduction. Without it the compiler keeps the unpacked fp32
// copies of the 16-bit inputs alive from one phase to the next: ptxas (CUDA 13.0, sm_90) gave the bf16 backward
// kernel 118 registers (one 320-thread CTA per SM on 2560-wide rows); with it 94 (two CTAs).
template <typename T, int VEC>
__device__ __forceinline__ void keep_packed(Vec<T, VEC>& v) {
  if constexpr (sizeof(Vec<T, VEC>) % 4 == 0) {
    constexpr int W = sizeof(Vec<T, VEC>) / 4;
    uint32_t* w = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
    for (int i = 0; i < W; ++i) asm volatile("" : "+r"(w[i]));  // opaque: the fp32 values must be recomputed
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Forward. Block = (tpr threads per row, rpb rows); rpb > 1 only when tpr == 32 (warp per row).
template <typename T, typename WT, int VEC, int ITEMS>
__global__ void sandwich_norm_fwd_kernel(const T* __restrict__ branch,    // [rows, N] addressed through bi
                                         RowIndexer bi,
                                         const T* __restrict__ residual,  // [rows, N] addressed through ri
                                         RowIndexer ri,
                                         const WT* __restrict__ post_w,   // [N] or nullptr
                                         const WT* __restrict__ pre_w,    // [N] or nullptr
                                         T* __restrict__ s,               // [rows, N] contiguous
                                         T* __restrict__ y,               // [rows, N] contiguous
                                         int64_t rows, int N, float eps, float inv_n) {
  // one buffer per reduction: a fast warp may publish the second sum before a slow one has read the first
  __shared__ float buf[2][32];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= rows) return;  // only with rpb > 1, where there is no block-wide barrier
  const int tid = threadIdx.x, tpr = blockDim.x;
  const int nvec = N / VEC;

  const T* br = branch + bi.offset(row);
  const T* rr = residual + ri.offset(row);
  Vec<T, VEC> bv[ITEMS], sv[ITEMS];  // sv holds the residual, then the rounded sum
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int c = i * tpr + tid;
    if (c < nvec) {
      bv[i] = load_vec<T, VEC>(br + int64_t(c) * VEC);
      sv[i] = load_vec<T, VEC>(rr + int64_t(c) * VEC);
    }
  }
  float sb[1] = {0.f};
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    if (i * tpr + tid < nvec) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float f = to_float(bv[i].v[k]);
        sb[0] += f * f;
      }
    }
  }
  row_sum<1>(sb, buf[0]);
  const float inv_b = inverse_rms(sb[0], inv_n, eps);

  T* sr = s + row * N;
  float ss[1] = {0.f};
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int c = i * tpr + tid;
    if (c < nvec) {
      Vec<WT, VEC> wv;
      if (post_w != nullptr) wv = load_vec<WT, VEC>(post_w + int64_t(c) * VEC);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        float n = to_float(bv[i].v[k]) * inv_b;
        if (post_w != nullptr) n = n * to_float(wv.v[k]);
        sv[i].v[k] = from_float<T>(to_float(sv[i].v[k]) + n);
        const float f = to_float(sv[i].v[k]);  // the pre-norm sees the rounded sum, as the reference does
        ss[0] += f * f;
      }
      store_vec<T, VEC>(sr + int64_t(c) * VEC, sv[i]);
    }
  }
  row_sum<1>(ss, buf[1]);
  const float inv_s = inverse_rms(ss[0], inv_n, eps);

  T* yr = y + row * N;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int c = i * tpr + tid;
    if (c < nvec) {
      Vec<T, VEC> out;
      if (pre_w != nullptr) {
        const Vec<WT, VEC> wv = load_vec<WT, VEC>(pre_w + int64_t(c) * VEC);
#pragma unroll
        for (int k = 0; k < VEC; ++k) out.v[k] = from_float<T>((to_float(sv[i].v[k]) * inv_s) * to_float(wv.v[k]));
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) out.v[k] = from_float<T>(to_float(sv[i].v[k]) * inv_s);
      }
      store_vec<T, VEC>(yr + int64_t(c) * VEC, out);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Backward. WITH_DW (a weight gradient wanted): persistent over rows (grid-stride by groups of rpb rows) so that each
// CTA row slot's weight-gradient partials cover a fixed, deterministic set of rows. Without (frozen or absent
// weights, as under LoRA): one group per CTA, as the forward; the persistent loop costs registers and so occupancy
// (rms_norm.cu's rms_norm_bwd_kernel: bf16 at 2560 columns, 56 registers per thread here against 96).
template <typename T, typename WT, int VEC, int ITEMS, bool WITH_DW>
__global__ void sandwich_norm_bwd_kernel(const T* __restrict__ grad_sum,        // [rows, N] through gsi
                                         RowIndexer gsi,
                                         const T* __restrict__ grad_normed,     // [rows, N] through gni
                                         RowIndexer gni,
                                         const T* __restrict__ branch,          // [rows, N] through bi
                                         RowIndexer bi,
                                         const T* __restrict__ s,               // [rows, N] through si
                                         RowIndexer si,
                                         const WT* __restrict__ post_w,         // [N] or nullptr
                                         const WT* __restrict__ pre_w,          // [N] or nullptr
                                         T* __restrict__ grad_branch,           // [rows, N] contiguous
                                         T* __restrict__ grad_residual,         // [rows, N] contiguous
                                         float* __restrict__ post_partial,      // [gridDim.x * rpb, N] or nullptr
                                         float* __restrict__ pre_partial,       // [gridDim.x * rpb, N] or nullptr
                                         int64_t rows, int N, float eps, float inv_n) {
  // two reductions per row, one buffer each: consecutive reductions never share a buffer, and each is
  // separated from the previous use of its buffer by the other reduction's barrier
  __shared__ float buf_a[32 * 3], buf_b[32];
  const int tid = threadIdx.x, tpr = blockDim.x, rpb = blockDim.y;
  const int nvec = N / VEC;
  float acc_post[ITEMS][VEC], acc_pre[ITEMS][VEC];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i)
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc_post[i][k] = acc_pre[i][k] = 0.f;

  for (int64_t group = blockIdx.x; group * rpb < rows; group += gridDim.x) {
    const int64_t row = group * rpb + threadIdx.y;
    if (row >= rows) {  // only with rpb > 1 (warp-only reductions)
      if (!WITH_DW) return;
      continue;
    }
    const T* gsr = grad_sum + gsi.offset(row);
    const T* gnr = grad_normed + gni.offset(row);
    const T* br = branch + bi.offset(row);
    const T* sr = s + si.offset(row);
    Vec<T, VEC> gsv[ITEMS], gnv[ITEMS], bv[ITEMS], sv[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c = i * tpr + tid;
      if (c < nvec) {
        gsv[i] = load_vec<T, VEC>(gsr + int64_t(c) * VEC);
        gnv[i] = load_vec<T, VEC>(gnr + int64_t(c) * VEC);
        bv[i] = load_vec<T, VEC>(br + int64_t(c) * VEC);
        sv[i] = load_vec<T, VEC>(sr + int64_t(c) * VEC);
      }
    }
    // everything that does not depend on ds: sum s^2, sum (gn * wpre) * s, sum b^2
    float sums[3] = {0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c = i * tpr + tid;
      if (c < nvec) {
        Vec<WT, VEC> wv;
        if (pre_w != nullptr) wv = load_vec<WT, VEC>(pre_w + int64_t(c) * VEC);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float sf = to_float(sv[i].v[k]), bf = to_float(bv[i].v[k]);
          const float gn = to_float(gnv[i].v[k]);
          const float g2 = pre_w != nullptr ? __fmul_rn(gn, to_float(wv.v[k])) : gn;
          sums[0] = __fmaf_rn(sf, sf, sums[0]);
          sums[1] = __fmaf_rn(g2, sf, sums[1]);
          sums[2] = __fmaf_rn(bf, bf, sums[2]);
        }
      }
    }
    row_sum<3>(sums, buf_a);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      keep_packed(gsv[i]);
      keep_packed(gnv[i]);
      keep_packed(bv[i]);
      keep_packed(sv[i]);
    }
    const float inv_s = inverse_rms(sums[0], inv_n, eps);
    const float m_s = (sums[1] * inv_s) * inv_n;  // mean(g2 * s_hat)
    const float inv_b = inverse_rms(sums[2], inv_n, eps);

    // ds in fp32 (kept in registers for grad_branch), grad_residual, and the sum the post-norm backward needs
    float ds[ITEMS][VEC];
    float dot[1] = {0.f};  // sum (ds * wpost) * b
    T* grr = grad_residual + row * N;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c = i * tpr + tid;
      if (c < nvec) {
        Vec<WT, VEC> wq, wp;
        if (pre_w != nullptr) wq = load_vec<WT, VEC>(pre_w + int64_t(c) * VEC);
        if (post_w != nullptr) wp = load_vec<WT, VEC>(post_w + int64_t(c) * VEC);
        Vec<T, VEC> out;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float s_hat = __fmul_rn(to_float(sv[i].v[k]), inv_s);
          const float gn = to_float(gnv[i].v[k]);
          const float g2 = pre_w != nullptr ? __fmul_rn(gn, to_float(wq.v[k])) : gn;
          const float d = __fmaf_rn(inv_s, __fmaf_rn(-s_hat, m_s, g2), to_float(gsv[i].v[k]));
          ds[i][k] = d;
          out.v[k] = from_float<T>(d);
          if (WITH_DW) acc_pre[i][k] = __fmaf_rn(gn, s_hat, acc_pre[i][k]);
          const float g1 = post_w != nullptr ? __fmul_rn(d, to_float(wp.v[k])) : d;
          dot[0] = __fmaf_rn(g1, to_float(bv[i].v[k]), dot[0]);
        }
        store_vec<T, VEC>(grr + int64_t(c) * VEC, out);
      }
    }
    row_sum<1>(dot, buf_b);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) keep_packed(bv[i]);
    const float m_b = (dot[0] * inv_b) * inv_n;  // mean(g1 * b_hat)

    T* gbr = grad_branch + row * N;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c = i * tpr + tid;
      if (c < nvec) {
        Vec<WT, VEC> wp;
        if (post_w != nullptr) wp = load_vec<WT, VEC>(post_w + int64_t(c) * VEC);
        Vec<T, VEC> out;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float b_hat = __fmul_rn(to_float(bv[i].v[k]), inv_b);
          const float g1 = post_w != nullptr ? __fmul_rn(ds[i][k], to_float(wp.v[k])) : ds[i][k];
          out.v[k] = from_float<T>(__fmul_rn(inv_b, __fmaf_rn(-b_hat, m_b, g1)));
          if (WITH_DW) acc_post[i][k] = __fmaf_rn(ds[i][k], b_hat, acc_post[i][k]);
        }
        store_vec<T, VEC>(gbr + int64_t(c) * VEC, out);
      }
    }
    if (!WITH_DW) return;  // one group per CTA: the grid covers every group
  }

  // every slot writes its partial row, also a slot that got no rows (zeros), so the second pass reads no garbage
  const int64_t slot = int64_t(blockIdx.x) * rpb + threadIdx.y;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int c = i * tpr + tid;
    if (c < nvec) {
      if (post_partial != nullptr) {
        Vec<float, VEC> o;
#pragma unroll
        for (int k = 0; k < VEC; ++k) o.v[k] = acc_post[i][k];
        store_vec<float, VEC>(post_partial + slot * N + int64_t(c) * VEC, o);
      }
      if (pre_partial != nullptr) {
        Vec<float, VEC> o;
#pragma unroll
        for (int k = 0; k < VEC; ++k) o.v[k] = acc_pre[i][k];
        store_vec<float, VEC>(pre_partial + slot * N + int64_t(c) * VEC, o);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// ATen path: float64, very wide rows, gradients of another dtype. Same expressions as ops/reference.py (the rms_norm
// pieces, normalized_aten and rms_norm_backward_acc_aten, are in g4ops_common.cuh).

std::tuple<at::Tensor, at::Tensor> sandwich_norm_aten(const at::Tensor& branch, const at::Tensor& residual,
                                                      const std::optional<at::Tensor>& post_weight,
                                                      const std::optional<at::Tensor>& pre_weight, double eps) {
  const at::Tensor n = normalized_aten(branch, post_weight, eps);
  const at::Tensor s = (residual.to(n.scalar_type()) + n).to(residual.scalar_type()).contiguous();
  const at::Tensor y = normalized_aten(s, pre_weight, eps).to(s.scalar_type()).contiguous();
  return {s, y};
}


std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sandwich_norm_backward_aten(
    const at::Tensor& grad_sum, const at::Tensor& grad_normed, const at::Tensor& branch, const at::Tensor& s,
    const std::optional<at::Tensor>& post_weight, const std::optional<at::Tensor>& pre_weight, double eps,
    std::array<bool, 2> weight_grads) {
  at::Tensor grad_s, grad_pre, grad_b, grad_post;
  std::tie(grad_s, grad_pre) = rms_norm_backward_acc_aten(grad_normed, s, pre_weight, eps, weight_grads[1]);
  const at::Tensor ds = grad_s + grad_sum.to(grad_s.scalar_type());
  std::tie(grad_b, grad_post) = rms_norm_backward_acc_aten(ds, branch, post_weight, eps, weight_grads[0]);
  return {grad_b.to(branch.scalar_type()).contiguous(), ds.to(s.scalar_type()).contiguous(), grad_post, grad_pre};
}

// ---------------------------------------------------------------------------------------------------------------
// Host helpers.

// The two kernel weights in one type: kernel_weight() each; if one is fp32 and the other is T, both go fp32.
std::tuple<at::Tensor, at::Tensor> kernel_weights(const std::optional<at::Tensor>& post_weight,
                                                  const std::optional<at::Tensor>& pre_weight, at::ScalarType xdt) {
  at::Tensor post = kernel_weight(post_weight, xdt), pre = kernel_weight(pre_weight, xdt);
  if (post.defined() && pre.defined() && post.scalar_type() != pre.scalar_type()) {
    post = post.to(at::kFloat);
    pre = pre.to(at::kFloat);
  }
  return {post, pre};
}

bool fp32_weights(const at::Tensor& post, const at::Tensor& pre) {
  return (post.defined() && post.scalar_type() == at::kFloat) || (pre.defined() && pre.scalar_type() == at::kFloat);
}

template <typename WT>
const WT* weight_ptr(const at::Tensor& w) {
  return w.defined() ? reinterpret_cast<const WT*>(w.data_ptr()) : nullptr;
}

// 16-byte vectors need N, every row start and every weight aligned to the vector (as rms_norm.cu's pick_vec).
template <typename T>
bool rows_vec_ok(const at::Tensor& t, const RowIndexer& ri) {
  return aligned_to(t.data_ptr(), 16) && row_strides_multiple_of(ri, 16 / sizeof(T));
}

template <typename T, typename WT>
bool weight_vec_ok(const WT* w) {
  return w == nullptr || aligned_to(w, sizeof(WT) * (16 / sizeof(T)));
}

// Next layout to try when a kernel's registers do not allow pick_config's threads per row: twice the vectors per
// thread, half the threads. The registers per row grow slower than ITEMS (ptxas, bf16 backward: 94 / 132 / 234 at
// ITEMS 1 / 2 / 4), so 8192-wide bf16 rows fit at ITEMS 4 where they do not at 1 or 2.
bool widen_items(RowConfig& cfg, int N, int max_items) {
  if (cfg.vec == 1 || cfg.items >= max_items) return false;
  cfg.items *= 2;
  const int need = (N / cfg.vec + cfg.items - 1) / cfg.items;
  cfg.tpr = std::max(32, (need + 31) / 32 * 32);
  cfg.rpb = cfg.tpr == 32 ? 4 : 1;
  return true;
}

// Weight gradient from the [P, N] fp32 partials: fixed-order column sums, in the weight's dtype.
at::Tensor finish_weight_grad(const float* partial, int P, int N, const at::Tensor& weight, cudaStream_t stream) {
  const auto wdt = weight.scalar_type();
  const bool direct = wdt == at::kFloat || wdt == at::kHalf || wdt == at::kBFloat16;
  at::Tensor dw = at::empty({int64_t(N)}, weight.options().dtype(direct ? wdt : at::kFloat));
  const dim3 block(32, 16);
  const dim3 grid((N + 31) / 32);
  G4OPS_DISPATCH_HALF_BF16_FLOAT(dw.scalar_type(), "g4ops.sandwich_norm_backward", [&] {
    reduce_partials_kernel<scalar_t><<<grid, block, 0, stream>>>(partial, reinterpret_cast<scalar_t*>(dw.data_ptr()),
                                                                  P, N);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return direct ? dw : dw.to(wdt);
}

// ---------------------------------------------------------------------------------------------------------------
// Forward launcher.

struct FwdArgs {
  const at::Tensor* branch;
  RowIndexer bi;
  const at::Tensor* residual;
  RowIndexer ri;
  const at::Tensor* post;  // kernel weights (undefined: none)
  const at::Tensor* pre;
  at::Tensor* s;
  at::Tensor* y;
  int64_t rows;
  int N;
  float eps;
};

template <typename T, typename WT, int VEC, int ITEMS>
bool launch_fwd(const RowConfig& cfg, const FwdArgs& a) {
  auto kernel = sandwich_norm_fwd_kernel<T, WT, VEC, ITEMS>;
  if (cfg.tpr * cfg.rpb > kernel_max_threads(reinterpret_cast<const void*>(kernel))) return false;
  const dim3 block(cfg.tpr, cfg.rpb);
  const int64_t grid = (a.rows + cfg.rpb - 1) / cfg.rpb;
  kernel<<<static_cast<unsigned>(grid), block, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const T*>(a.branch->data_ptr()), a.bi, reinterpret_cast<const T*>(a.residual->data_ptr()),
      a.ri, weight_ptr<WT>(*a.post), weight_ptr<WT>(*a.pre), reinterpret_cast<T*>(a.s->data_ptr()),
      reinterpret_cast<T*>(a.y->data_ptr()), a.rows, a.N, a.eps, 1.0f / float(a.N));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

template <typename T, typename WT>
bool sandwich_fwd_typed(const FwdArgs& a) {
  constexpr int V = 16 / sizeof(T);
  const bool vec_ok = a.N % V == 0 && rows_vec_ok<T>(*a.branch, a.bi) && rows_vec_ok<T>(*a.residual, a.ri) &&
                      weight_vec_ok<T, WT>(weight_ptr<WT>(*a.post)) && weight_vec_ok<T, WT>(weight_ptr<WT>(*a.pre));
  RowConfig cfg;
  if (!pick_config(a.N, vec_ok ? V : 1, 8, cfg)) return false;
  if (cfg.vec == 1) return launch_fwd<T, WT, 1, 8>(cfg, a);
  do {
    bool launched = false;
    switch (cfg.items) {
      case 1: launched = launch_fwd<T, WT, V, 1>(cfg, a); break;
      case 2: launched = launch_fwd<T, WT, V, 2>(cfg, a); break;
      case 4: launched = launch_fwd<T, WT, V, 4>(cfg, a); break;
      default: launched = launch_fwd<T, WT, V, 8>(cfg, a); break;
    }
    if (launched) return true;
  } while (widen_items(cfg, a.N, 8));
  return false;
}

std::tuple<at::Tensor, at::Tensor> sandwich_norm_cuda(const at::Tensor& branch_in, const at::Tensor& residual_in,
                                                      const std::optional<at::Tensor>& post_weight,
                                                      const std::optional<at::Tensor>& pre_weight, double eps) {
  // inputs were checked by ops/core.py (BackendSelect guard) before this kernel runs
  const c10::cuda::CUDAGuard guard(branch_in.device());
  const auto dt = branch_in.scalar_type();
  if (dt == at::kDouble) return sandwich_norm_aten(branch_in, residual_in, post_weight, pre_weight, eps);
  const auto out_opts = branch_in.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor s = at::empty(branch_in.sizes(), out_opts);
  at::Tensor y = at::empty(branch_in.sizes(), out_opts);
  if (s.numel() == 0) return {s, y};
  const int64_t N64 = branch_in.size(-1);
  G4OPS_CHECK(N64 <= INT32_MAX, "g4ops.sandwich_norm: last dim of `branch` too large: ", N64);
  FwdArgs a;
  const at::Tensor branch = rows_operand(branch_in, a.bi);
  const at::Tensor residual = rows_operand(residual_in, a.ri);
  at::Tensor post, pre;
  std::tie(post, pre) = kernel_weights(post_weight, pre_weight, dt);
  a.branch = &branch;
  a.residual = &residual;
  a.post = &post;
  a.pre = &pre;
  a.s = &s;
  a.y = &y;
  a.N = static_cast<int>(N64);
  a.rows = s.numel() / N64;
  a.eps = static_cast<float>(eps);
  bool ok = false;
  G4OPS_DISPATCH_HALF_BF16_FLOAT(dt, "g4ops.sandwich_norm", [&] {
    if (!std::is_same<scalar_t, float>::value && fp32_weights(post, pre)) {
      ok = sandwich_fwd_typed<scalar_t, float>(a);
    } else {
      ok = sandwich_fwd_typed<scalar_t, scalar_t>(a);
    }
  });
  if (!ok) return sandwich_norm_aten(branch_in, residual_in, post_weight, pre_weight, eps);  // row too wide
  return {s, y};
}

// ---------------------------------------------------------------------------------------------------------------
// Backward launcher.

struct BwdArgs {
  const at::Tensor* grad_sum;
  RowIndexer gsi;
  const at::Tensor* grad_normed;
  RowIndexer gni;
  const at::Tensor* branch;
  RowIndexer bi;
  const at::Tensor* s;
  RowIndexer si;
  const at::Tensor* post;  // kernel weights (undefined: none)
  const at::Tensor* pre;
  at::Tensor* grad_branch;
  at::Tensor* grad_residual;
  bool want_post, want_pre;
  int64_t rows;
  int N;
  float eps;
  // set by the launcher
  at::Tensor partial;  // [want_post + want_pre, P, N] fp32
  int P;
};

template <typename T, typename WT, int VEC, int ITEMS>
bool launch_bwd(const RowConfig& cfg, BwdArgs& a) {
  const int nparts = int(a.want_post) + int(a.want_pre);
  auto with_dw = sandwich_norm_bwd_kernel<T, WT, VEC, ITEMS, true>;
  auto kernel = nparts > 0 ? with_dw : sandwich_norm_bwd_kernel<T, WT, VEC, ITEMS, false>;
  const int threads = cfg.tpr * cfg.rpb;
  // as rms_norm.cu's launch_bwd: where the weight-gradient kernel cannot launch, neither kind of call takes a kernel,
  // so the gradients never depend on which weight gradients were asked for
  if (threads > kernel_max_threads(reinterpret_cast<const void*>(with_dw))) return false;
  if (threads > kernel_max_threads(reinterpret_cast<const void*>(kernel))) return false;
  const int64_t groups = (a.rows + cfg.rpb - 1) / cfg.rpb;
  int64_t grid = groups;
  float* post_partial = nullptr;
  float* pre_partial = nullptr;
  if (nparts > 0) {
    // the grid (and so the partial layout) depends only on the kernel and the device: deterministic
    const int per_sm = blocks_per_sm(reinterpret_cast<const void*>(kernel), threads);
    grid = std::min<int64_t>(groups, int64_t(std::max(per_sm, 1)) * num_sms());
    a.P = static_cast<int>(grid) * cfg.rpb;
    a.partial = at::empty({nparts, int64_t(a.P), int64_t(a.N)}, a.branch->options().dtype(at::kFloat));
    float* base = a.partial.data_ptr<float>();
    if (a.want_post) post_partial = base;
    if (a.want_pre) pre_partial = base + (a.want_post ? int64_t(a.P) * a.N : 0);
  }
  kernel<<<static_cast<unsigned>(grid), dim3(cfg.tpr, cfg.rpb), 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const T*>(a.grad_sum->data_ptr()), a.gsi,
      reinterpret_cast<const T*>(a.grad_normed->data_ptr()), a.gni, reinterpret_cast<const T*>(a.branch->data_ptr()),
      a.bi, reinterpret_cast<const T*>(a.s->data_ptr()), a.si, weight_ptr<WT>(*a.post), weight_ptr<WT>(*a.pre),
      reinterpret_cast<T*>(a.grad_branch->data_ptr()), reinterpret_cast<T*>(a.grad_residual->data_ptr()),
      post_partial, pre_partial, a.rows, a.N, a.eps, 1.0f / float(a.N));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

template <typename T, typename WT>
bool sandwich_bwd_typed(BwdArgs& a) {
  constexpr int V = 16 / sizeof(T);
  const bool vec_ok = a.N % V == 0 && rows_vec_ok<T>(*a.grad_sum, a.gsi) && rows_vec_ok<T>(*a.grad_normed, a.gni) &&
                      rows_vec_ok<T>(*a.branch, a.bi) && rows_vec_ok<T>(*a.s, a.si) &&
                      weight_vec_ok<T, WT>(weight_ptr<WT>(*a.post)) && weight_vec_ok<T, WT>(weight_ptr<WT>(*a.pre));
  RowConfig cfg;
  if (!pick_config(a.N, vec_ok ? V : 1, 4, cfg)) return false;
  if (cfg.vec == 1) return launch_bwd<T, WT, 1, 8>(cfg, a);
  do {
    bool launched = false;
    switch (cfg.items) {
      case 1: launched = launch_bwd<T, WT, V, 1>(cfg, a); break;
      case 2: launched = launch_bwd<T, WT, V, 2>(cfg, a); break;
      default: launched = launch_bwd<T, WT, V, 4>(cfg, a); break;
    }
    if (launched) return true;
  } while (widen_items(cfg, a.N, 4));
  return false;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sandwich_norm_backward_cuda(
    const at::Tensor& grad_sum_in, const at::Tensor& grad_normed_in, const at::Tensor& branch_in,
    const at::Tensor& s_in, const std::optional<at::Tensor>& post_weight, const std::optional<at::Tensor>& pre_weight,
    double eps, std::array<bool, 2> weight_grads) {
  // inputs were checked by ops/core.py (BackendSelect guard) before this kernel runs
  const c10::cuda::CUDAGuard guard(branch_in.device());
  const auto dt = branch_in.scalar_type();
  const bool want_post = post_weight.has_value() && weight_grads[0];
  const bool want_pre = pre_weight.has_value() && weight_grads[1];
  if (branch_in.numel() == 0) {  // a sum over no rows: zero weight gradients
    const auto out_opts = branch_in.options().memory_format(at::MemoryFormat::Contiguous);
    return {at::empty(branch_in.sizes(), out_opts), at::empty(branch_in.sizes(), out_opts),
            want_post ? at::zeros(post_weight->sizes(), post_weight->options()) : at::empty({0}, branch_in.options()),
            want_pre ? at::zeros(pre_weight->sizes(), pre_weight->options()) : at::empty({0}, branch_in.options())};
  }
  // float64, and gradients the kernels would have to round to branch's dtype first: the ATen math
  if (dt == at::kDouble || grad_sum_in.scalar_type() != dt || grad_normed_in.scalar_type() != dt) {
    return sandwich_norm_backward_aten(grad_sum_in, grad_normed_in, branch_in, s_in, post_weight, pre_weight, eps,
                                       weight_grads);
  }
  const int64_t N64 = branch_in.size(-1);
  G4OPS_CHECK(N64 <= INT32_MAX, "g4ops.sandwich_norm_backward: last dim of `branch` too large: ", N64);
  const auto out_opts = branch_in.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor grad_branch = at::empty(branch_in.sizes(), out_opts);
  at::Tensor grad_residual = at::empty(branch_in.sizes(), out_opts);
  BwdArgs a;
  const at::Tensor grad_sum = rows_operand(grad_sum_in, a.gsi);
  const at::Tensor grad_normed = rows_operand(grad_normed_in, a.gni);
  const at::Tensor branch = rows_operand(branch_in, a.bi);
  const at::Tensor s = rows_operand(s_in, a.si);
  at::Tensor post, pre;
  std::tie(post, pre) = kernel_weights(post_weight, pre_weight, dt);
  a.grad_sum = &grad_sum;
  a.grad_normed = &grad_normed;
  a.branch = &branch;
  a.s = &s;
  a.post = &post;
  a.pre = &pre;
  a.grad_branch = &grad_branch;
  a.grad_residual = &grad_residual;
  a.want_post = want_post;
  a.want_pre = want_pre;
  a.N = static_cast<int>(N64);
  a.rows = branch_in.numel() / N64;
  a.eps = static_cast<float>(eps);
  a.P = 0;
  bool ok = false;
  G4OPS_DISPATCH_HALF_BF16_FLOAT(dt, "g4ops.sandwich_norm_backward", [&] {
    if (!std::is_same<scalar_t, float>::value && fp32_weights(post, pre)) {
      ok = sandwich_bwd_typed<scalar_t, float>(a);
    } else {
      ok = sandwich_bwd_typed<scalar_t, scalar_t>(a);
    }
  });
  if (!ok) {  // row too wide for the register-cached kernel
    return sandwich_norm_backward_aten(grad_sum_in, grad_normed_in, branch_in, s_in, post_weight, pre_weight, eps,
                                       weight_grads);
  }
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const float* partial = want_post || want_pre ? a.partial.data_ptr<float>() : nullptr;
  at::Tensor grad_post = want_post ? finish_weight_grad(partial, a.P, a.N, *post_weight, stream)
                                   : at::empty({0}, branch_in.options());
  at::Tensor grad_pre = want_pre ? finish_weight_grad(partial + (want_post ? int64_t(a.P) * a.N : 0), a.P, a.N,
                                                      *pre_weight, stream)
                                 : at::empty({0}, branch_in.options());
  return {grad_branch, grad_residual, grad_post, grad_pre};
}

}  // namespace

TORCH_LIBRARY_IMPL(g4ops, CUDA, m) {
  m.impl("sandwich_norm", &sandwich_norm_cuda);
  m.impl("sandwich_norm_backward", &sandwich_norm_backward_cuda);
}

}  // namespace g4ops
