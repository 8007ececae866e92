// geglu.cu: CUDA kernels for g4ops::geglu_mlp, g4ops::geglu_mlp_forward and g4ops::geglu_mlp_backward, and for the
// GeGLU product alone, g4ops::gelu_tanh_mul and g4ops::gelu_tanh_mul_backward (Gemma-4's per-layer-input gate).
//
// Semantics (the contract is g4ops/ops/reference.py; design.md section 4). Weights are nn.Linear [out, in], no bias.
//   forward   gate = x @ w_gate.T, up = x @ w_up.T (GEMM outputs, rounded to x.dtype like F.linear's)
//             h    = cast( gelu_tanh(gate32) * up32 )          one rounding; the gelu is ATen's tanh formula
//             out  = h @ w_down.T
//   backward  dh = grad_out @ w_down;  from (dh, gate, up), in fp32, each output rounded once:
//             dgate = gelu_tanh'(gate) * (dh * up),  dup = dh * gelu_tanh(gate),  h recomputed (not saved)
//             grad_x = dgate @ w_gate + dup @ w_up (the second GEMM accumulates into the first: addmm)
//             grad_w_gate = dgate.T @ x, grad_w_up = dup.T @ x, grad_w_down = grad_out.T @ h
//             Outputs whose output_mask entry is false are empty tensors (x.new_empty(0)); nothing else is computed
//             for them.
// GEMMs are cuBLAS through ATen (at::mm / addmm_) on the current stream. The GeGLU product and its backward are
// fused elementwise kernels (16-byte vectors, scalar tail). float64 runs the same kernels with double math.
// Decode path: for 1 row (kernels take up to 8; see gemv_eligible) of float16/bfloat16 with 16-byte-aligned
// contiguous operands, two GEMV kernels
// replace the three GEMMs: the first streams w_gate and w_up once (16-byte no-L1 loads, several in flight per lane),
// rounds gate/up to x.dtype (so it computes what the GEMM path computes, up to summation order) and applies the
// GeGLU epilogue; the second streams w_down. Every output element is assigned exactly once; nothing accumulates
// into caller memory.

#include "g4ops_common.cuh"

#include <ATen/TensorUtils.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <vector>

namespace g4ops {
namespace {

// ATen's tanh-approximate GELU (aten/src/ATen/native/cuda/ActivationGeluKernel.cu, GeluCUDAKernelImpl and
// GeluBackwardCUDAKernelImpl, GeluType::Tanh), written in the accumulation type A.
template <typename A>
__device__ __forceinline__ A gelu_tanh(A x) {
  constexpr A kBeta = A(M_SQRT2 * M_2_SQRTPI * 0.5);
  constexpr A kKappa = A(0.044715);
  const A x_cube = x * x * x;
  const A inner = kBeta * (x + kKappa * x_cube);
  return A(0.5) * x * (A(1) + tanh(inner));
}

// d/dx gelu_tanh(x) * dy, and gelu_tanh(x) from the same tanh.
template <typename A>
__device__ __forceinline__ void gelu_tanh_backward(A x, A dy, A& grad, A& gelu) {
  constexpr A kBeta = A(M_SQRT2 * M_2_SQRTPI * 0.5);
  constexpr A kKappa = A(0.044715);
  const A x_sq = x * x;
  const A x_cube = x_sq * x;
  const A inner = kBeta * (x + kKappa * x_cube);
  const A tanh_inner = tanh(inner);
  const A left = A(0.5) * x;
  const A right = A(1) + tanh_inner;
  const A left_derivative = A(0.5) * right;
  const A tanh_derivative = A(1) - tanh_inner * tanh_inner;
  const A inner_derivative = kBeta * (A(1) + A(3) * kKappa * x_sq);
  const A right_derivative = left * tanh_derivative * inner_derivative;
  grad = dy * (left_derivative + right_derivative);
  gelu = left * right;  // == 0.5 * x * (1 + tanh(inner)), the forward's value
}

// ---------------------------------------------------------------------------------------------------------------
// Elementwise kernels over n elements. Outputs and dh are contiguous; g and u are rows of `cols` elements whose
// starts lie g_ld and u_ld elements apart (ld == cols: contiguous). STRIDED == false reads them as contiguous
// (the MLP's own GEMM outputs) without the per-vector division; true serves a slice along a middle dim, such as
// Gemma-4's per-layer input per_layer_inputs[:, :, i, :], without a copy. A VEC-element vector never crosses a row:
// the host takes VEC > 1 only when cols and both ld are multiples of VEC.
template <bool STRIDED>
__device__ __forceinline__ int64_t row_offset(int64_t e, int64_t cols, int64_t ld) {
  if constexpr (!STRIDED) {
    return e;
  } else {
    const int64_t row = e / cols;
    return row * ld + (e - row * cols);
  }
}

// Forward: h = cast(gelu_tanh(g) * u). VEC elements per thread step; the last n % VEC elements (VEC > 1) are done
// one by one by the first threads.
template <typename T, int VEC, bool STRIDED>
__global__ void geglu_fwd_kernel(const T* __restrict__ g,  // gate
                                 const T* __restrict__ u,  // up
                                 T* __restrict__ h,        // [n]
                                 int64_t n, int64_t cols, int64_t g_ld, int64_t u_ld) {
  using A = typename AccType<T>::type;
  const int64_t nv = n / VEC;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = tid; i < nv; i += stride) {
    const int64_t e = i * VEC;
    const Vec<T, VEC> gv = load_vec<T, VEC>(g + row_offset<STRIDED>(e, cols, g_ld));
    const Vec<T, VEC> uv = load_vec<T, VEC>(u + row_offset<STRIDED>(e, cols, u_ld));
    Vec<T, VEC> hv;
#pragma unroll
    for (int k = 0; k < VEC; ++k)
      hv.v[k] = from_acc<T, A>(gelu_tanh(to_acc<A>(gv.v[k])) * to_acc<A>(uv.v[k]));
    store_vec<T, VEC>(h + e, hv);
  }
  const int64_t t = nv * VEC + tid;
  if (t < n) {
    const A gf = to_acc<A>(g[row_offset<STRIDED>(t, cols, g_ld)]);
    h[t] = from_acc<T, A>(gelu_tanh(gf) * to_acc<A>(u[row_offset<STRIDED>(t, cols, u_ld)]));
  }
}

// Backward: from dh, g, u -> dg (nullable), du (nullable), h (nullable).
template <typename T, int VEC, bool STRIDED>
__global__ void geglu_bwd_kernel(const T* __restrict__ dh,  // [n] grad of h
                                 const T* __restrict__ g,   // gate
                                 const T* __restrict__ u,   // up
                                 T* __restrict__ dg,        // [n] or nullptr
                                 T* __restrict__ du,        // [n] or nullptr
                                 T* __restrict__ h,         // [n] or nullptr
                                 int64_t n, int64_t cols, int64_t g_ld, int64_t u_ld) {
  using A = typename AccType<T>::type;
  const int64_t nv = n / VEC;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool need_dh = dg != nullptr || du != nullptr;
  for (int64_t i = tid; i < nv; i += stride) {
    const int64_t e = i * VEC;
    Vec<T, VEC> dv;
    if (need_dh) dv = load_vec<T, VEC>(dh + e);
    const Vec<T, VEC> gv = load_vec<T, VEC>(g + row_offset<STRIDED>(e, cols, g_ld));
    const Vec<T, VEC> uv = load_vec<T, VEC>(u + row_offset<STRIDED>(e, cols, u_ld));
    Vec<T, VEC> ov_g, ov_u, ov_h;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const A gf = to_acc<A>(gv.v[k]), uf = to_acc<A>(uv.v[k]);
      const A df = need_dh ? to_acc<A>(dv.v[k]) : A(0);
      A grad, gel;
      gelu_tanh_backward(gf, df * uf, grad, gel);
      ov_g.v[k] = from_acc<T, A>(grad);
      ov_u.v[k] = from_acc<T, A>(df * gel);
      ov_h.v[k] = from_acc<T, A>(gel * uf);
    }
    if (dg != nullptr) store_vec<T, VEC>(dg + e, ov_g);
    if (du != nullptr) store_vec<T, VEC>(du + e, ov_u);
    if (h != nullptr) store_vec<T, VEC>(h + e, ov_h);
  }
  const int64_t t = nv * VEC + tid;
  if (t < n) {
    const A gf = to_acc<A>(g[row_offset<STRIDED>(t, cols, g_ld)]);
    const A uf = to_acc<A>(u[row_offset<STRIDED>(t, cols, u_ld)]);
    const A df = need_dh ? to_acc<A>(dh[t]) : A(0);
    A grad, gel;
    gelu_tanh_backward(gf, df * uf, grad, gel);
    if (dg != nullptr) dg[t] = from_acc<T, A>(grad);
    if (du != nullptr) du[t] = from_acc<T, A>(df * gel);
    if (h != nullptr) h[t] = from_acc<T, A>(gel * uf);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Decode GEMV: y[r, n] = sum_k x[r, k] * W[n, k] for r < m <= MT, one output row n per KSPLIT warps.
// NMAT == 2: two matrices (w_gate, w_up) share the x loads and the GeGLU epilogue writes h (and gate/up when asked).
// NMAT == 1: plain GEMV (w_down). Each lane keeps U 16-byte weight loads per matrix in flight, read with
// ld.global.nc.L1::no_allocate so the x rows (read by every warp) stay in L1.
constexpr int kGemvThreads = 128;

template <typename T, int MT, int NMAT, int KSPLIT, int U>
__global__ void __launch_bounds__(kGemvThreads) gemv_kernel(
    const T* __restrict__ x,      // [m, K] contiguous
    const T* __restrict__ w0,     // [N, K] contiguous (w_gate, or w_down)
    const T* __restrict__ w1,     // [N, K] contiguous (w_up) or nullptr
    T* __restrict__ y,            // [m, N]: h (NMAT == 2) or out (NMAT == 1)
    T* __restrict__ gate_out,     // [m, N] or nullptr (NMAT == 2)
    T* __restrict__ up_out,       // [m, N] or nullptr (NMAT == 2)
    int m, int N, int K) {
  constexpr int kWarps = kGemvThreads / 32;
  constexpr int kRowsPerBlock = kWarps / KSPLIT;
  __shared__ float part[kWarps][NMAT][MT];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kpart = warp % KSPLIT, rloc = warp / KSPLIT;
  const int row = blockIdx.x * kRowsPerBlock + rloc;
  const bool active = row < N;
  const int nchunk = K / 8;  // 16-byte chunks of 8 elements
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  const uint4* p0 = reinterpret_cast<const uint4*>(w0 + int64_t(active ? row : 0) * K);
  const uint4* p1 = NMAT == 2 ? reinterpret_cast<const uint4*>(w1 + int64_t(active ? row : 0) * K) : nullptr;

  float acc[NMAT][MT];
#pragma unroll
  for (int a = 0; a < NMAT; ++a)
#pragma unroll
    for (int r = 0; r < MT; ++r) acc[a][r] = 0.f;

  if (active) {
    for (int base = kpart * 32 + lane; base < nchunk; base += 32 * KSPLIT * U) {
      uint4 wv[NMAT][U];
#pragma unroll
      for (int j = 0; j < U; ++j) {
        const int c = base + j * 32 * KSPLIT;
        if (c < nchunk) {
          wv[0][j] = load_stream16(p0 + c);
          if (NMAT == 2) wv[NMAT - 1][j] = load_stream16(p1 + c);
        }
      }
#pragma unroll
      for (int j = 0; j < U; ++j) {
        const int c = base + j * 32 * KSPLIT;
        if (c < nchunk) {
          float wf[NMAT][8];
#pragma unroll
          for (int a = 0; a < NMAT; ++a) unpack8(wv[a][j], wf[a], T());
#pragma unroll
          for (int r = 0; r < MT; ++r) {
            if (r < m) {
              float xf[8];
              unpack8(__ldg(x4 + int64_t(r) * nchunk + c), xf, T());
#pragma unroll
              for (int a = 0; a < NMAT; ++a)
#pragma unroll
                for (int k = 0; k < 8; ++k) acc[a][r] = fmaf(xf[k], wf[a][k], acc[a][r]);
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int a = 0; a < NMAT; ++a)
#pragma unroll
    for (int r = 0; r < MT; ++r) acc[a][r] = warp_sum(acc[a][r]);

  if (KSPLIT > 1) {
    if (lane == 0) {
#pragma unroll
      for (int a = 0; a < NMAT; ++a)
#pragma unroll
        for (int r = 0; r < MT; ++r) part[warp][a][r] = acc[a][r];
    }
    __syncthreads();
    if (kpart != 0) return;
#pragma unroll
    for (int a = 0; a < NMAT; ++a)
#pragma unroll
      for (int r = 0; r < MT; ++r) {
        float t = 0.f;
#pragma unroll
        for (int s = 0; s < KSPLIT; ++s) t += part[rloc * KSPLIT + s][a][r];  // fixed order
        acc[a][r] = t;
      }
  }
  if (!active || lane != 0) return;
#pragma unroll
  for (int r = 0; r < MT; ++r) {
    if (r < m) {
      const int64_t o = int64_t(r) * N + row;
      if (NMAT == 2) {
        const T gq = from_float<T>(acc[0][r]);  // the GEMM output rounding
        const T uq = from_float<T>(acc[NMAT - 1][r]);
        y[o] = from_float<T>(gelu_tanh(to_float(gq)) * to_float(uq));
        if (gate_out != nullptr) gate_out[o] = gq;
        if (up_out != nullptr) up_out[o] = uq;
      } else {
        y[o] = from_float<T>(acc[0][r]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Host side.

void check_geglu_inputs(const char* op, const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
                        const at::Tensor& w_down) {
  const auto dt = x.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kHalf || dt == at::kBFloat16 || dt == at::kFloat || dt == at::kDouble,
              "g4ops: `x` must be float16, bfloat16, float32 or float64, got ", dt);
  G4OPS_CHECK(x.dim() >= 1, "g4ops.", op, ": `x` must have at least one dimension");
  const std::pair<const char*, const at::Tensor*> ws[] = {{"w_gate", &w_gate}, {"w_up", &w_up}, {"w_down", &w_down}};
  for (const auto& nw : ws) {
    const at::Tensor& w = *nw.second;
    const auto wt = w.scalar_type();
    TORCH_CHECK_TYPE(wt == at::kHalf || wt == at::kBFloat16 || wt == at::kFloat || wt == at::kDouble, "g4ops: `",
                nw.first, "` must be float16, bfloat16, float32 or float64, got ", wt);
    G4OPS_CHECK(w.dim() == 2, "g4ops.", op, ": `", nw.first, "` must be 2-D [out, in], got ", w.sizes());
    G4OPS_CHECK(wt == dt, "g4ops.", op, ": `", nw.first, "` is ", wt, " but `x` is ", dt,
                "; the MLP weights must have the activation dtype (under torch.autocast the op casts them for you)");
    G4OPS_CHECK(w.device() == x.device(), "g4ops.", op, ": `", nw.first, "` is on ", w.device(), " but `x` is on ",
                x.device());
  }
  const int64_t hidden = x.size(-1), inter = w_gate.size(0);
  G4OPS_CHECK(w_gate.size(1) == hidden, "g4ops.", op, ": `w_gate` must be [intermediate, ", hidden, "], got ",
              w_gate.sizes());
  G4OPS_CHECK(w_up.size(0) == inter && w_up.size(1) == hidden, "g4ops.", op, ": `w_up` must be [", inter, ", ",
              hidden, "] like `w_gate`, got ", w_up.sizes());
  G4OPS_CHECK(w_down.size(0) == hidden && w_down.size(1) == inter, "g4ops.", op, ": `w_down` must be [", hidden,
              ", ", inter, "], got ", w_down.sizes());
  G4OPS_CHECK(x.is_cuda(), "g4ops.", op, ": the CUDA kernel got `x` on ", x.device());
}

// x viewed as [rows, in] (rows = product of the leading dims, also when a dim is 0).
at::Tensor as_rows(const at::Tensor& x) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return x.reshape({rows, x.size(-1)});
}

std::vector<int64_t> with_last(const at::Tensor& x, int64_t last) {
  std::vector<int64_t> s(x.sizes().begin(), x.sizes().end());
  s.back() = last;
  return s;
}

int elementwise_grid(int64_t nvec) {
  const int64_t blocks = (nvec + 255) / 256;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(num_sms()) * 64)));
}

template <typename T>
bool vec_ok(std::initializer_list<const void*> ptrs, int64_t n) {
  constexpr int V = 16 / sizeof(T);
  (void)n;
  for (const void* p : ptrs)
    if (p != nullptr && !aligned_to(p, 16)) return false;
  return V > 1;
}

// [rows, cols] view of t (cols: its last dim) with unit column stride: t itself when its leading dims collapse into
// one row stride (contiguous, or a slice along a middle dim), else a contiguous copy.
at::Tensor row_matrix(const at::Tensor& t) {
  const int64_t cols = t.dim() == 0 ? 1 : t.size(-1);
  const int64_t rows = cols == 0 ? 0 : t.numel() / cols;
  const std::array<int64_t, 2> shape{rows, cols};
  const auto strides = at::detail::computeStride(t.sizes(), t.strides(), at::IntArrayRef(shape));
  if (strides.has_value() && (cols <= 1 || (*strides)[1] == 1))
    return t.as_strided({rows, cols}, {(*strides)[0], 1});
  return t.contiguous().view({rows, cols});
}

// The distance between a row matrix's row starts (its cols when it has one row: then any stride is allowed).
int64_t row_ld(const at::Tensor& m) { return m.size(0) > 1 ? m.stride(0) : m.size(1); }

// Launches a GeGLU kernel over n elements of the row matrices g and u (rows of `cols`): calls
// launch(VEC, STRIDED, grid) with std::integral_constant arguments, 16-byte vectors where every pointer is aligned
// and no vector crosses a row, the per-row offsets only where g or u is strided.
template <typename T, typename Launch>
void launch_geglu(int64_t n, int64_t cols, int64_t g_ld, int64_t u_ld, std::initializer_list<const void*> ptrs,
                  Launch launch) {
  constexpr int V = 16 / sizeof(T);
  const bool strided = g_ld != cols || u_ld != cols;
  const bool vec = vec_ok<T>(ptrs, n) && (!strided || (cols % V == 0 && g_ld % V == 0 && u_ld % V == 0));
  using Vec = std::integral_constant<int, V>;
  using One = std::integral_constant<int, 1>;
  if (vec && strided)
    launch(Vec{}, std::true_type{}, elementwise_grid(n / V + 1));
  else if (vec)
    launch(Vec{}, std::false_type{}, elementwise_grid(n / V + 1));
  else if (strided)
    launch(One{}, std::true_type{}, elementwise_grid(n));
  else
    launch(One{}, std::false_type{}, elementwise_grid(n));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// h = gelu_tanh(g) * u for row matrices g, u of one shape (`row_matrix`); h is a contiguous [rows, cols].
at::Tensor geglu_rows(const at::Tensor& g, const at::Tensor& u) {
  at::Tensor h = at::empty(g.sizes(), g.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t n = g.numel(), cols = g.size(1), g_ld = row_ld(g), u_ld = row_ld(u);
  if (n == 0) return h;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  G4OPS_DISPATCH_FLOATING(g.scalar_type(), "g4ops.gelu_tanh_mul", [&] {
    using T = scalar_t;
    const T* gp = reinterpret_cast<const T*>(g.data_ptr());
    const T* up = reinterpret_cast<const T*>(u.data_ptr());
    T* hp = reinterpret_cast<T*>(h.data_ptr());
    launch_geglu<T>(n, cols, g_ld, u_ld, {gp, up, hp}, [&](auto vec, auto strided, int grid) {
      geglu_fwd_kernel<T, decltype(vec)::value, decltype(strided)::value>
          <<<grid, 256, 0, stream>>>(gp, up, hp, n, cols, g_ld, u_ld);
    });
  });
  return h;
}

// From dh (contiguous [rows, cols]; may be undefined when only h is wanted) and row matrices g, u: whichever of dg,
// du, h is defined (contiguous [rows, cols], allocated by the caller) is written.
void geglu_backward_rows(const at::Tensor& dh, const at::Tensor& g, const at::Tensor& u, at::Tensor& dg,
                         at::Tensor& du, at::Tensor& h) {
  const int64_t n = g.numel(), cols = g.size(1), g_ld = row_ld(g), u_ld = row_ld(u);
  if (n == 0) return;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  G4OPS_DISPATCH_FLOATING(g.scalar_type(), "g4ops.gelu_tanh_mul_backward", [&] {
    using T = scalar_t;
    const T* dhp = dh.defined() ? reinterpret_cast<const T*>(dh.data_ptr()) : nullptr;
    const T* gp = reinterpret_cast<const T*>(g.data_ptr());
    const T* upp = reinterpret_cast<const T*>(u.data_ptr());
    T* dgp = dg.defined() ? reinterpret_cast<T*>(dg.data_ptr()) : nullptr;
    T* dup = du.defined() ? reinterpret_cast<T*>(du.data_ptr()) : nullptr;
    T* hp = h.defined() ? reinterpret_cast<T*>(h.data_ptr()) : nullptr;
    launch_geglu<T>(n, cols, g_ld, u_ld, {dhp, gp, upp, dgp, dup, hp}, [&](auto vec, auto strided, int grid) {
      geglu_bwd_kernel<T, decltype(vec)::value, decltype(strided)::value>
          <<<grid, 256, 0, stream>>>(dhp, gp, upp, dgp, dup, hp, n, cols, g_ld, u_ld);
    });
  });
}

// GEMV decode path applies: 1..8 rows, 16-bit dtype, contiguous aligned operands, K and I multiples of 8.
bool gemv_eligible(const at::Tensor& x2d, const at::Tensor& w_gate, const at::Tensor& w_up,
                   const at::Tensor& w_down) {
  const int64_t m = x2d.size(0), K = x2d.size(1), I = w_gate.size(0), H = w_down.size(0);
  // One row only: on the H200 (2026-11-29) the GEMV pair took 44.7 us at 1 row (cuBLAS 51-52 us) but 66.6 us at 4
  // rows (cuBLAS 51.8 us), so 2..8 rows stay on cuBLAS until the multi-row GEMV is tuned.
  if (m != 1) return false;
  const auto dt = x2d.scalar_type();
  if (dt != at::kHalf && dt != at::kBFloat16) return false;
  if (K % 8 != 0 || I % 8 != 0 || K == 0 || I == 0 || H == 0) return false;
  if (K > INT32_MAX / 8 || I > INT32_MAX / 8 || H > INT32_MAX) return false;
  for (const at::Tensor* w : {&w_gate, &w_up, &w_down})
    if (!w->is_contiguous() || !aligned_to(w->data_ptr(), 16)) return false;
  return true;
}

template <typename T, int MT>
void launch_gemv_pair(const T* x, const T* wg, const T* wu, const T* wd, T* h, T* gate, T* up, T* out, int m, int I,
                      int K, int H, cudaStream_t stream) {
  {
    constexpr int KSPLIT = 1;
    const int rows_per_block = (kGemvThreads / 32) / KSPLIT;
    const int grid = (I + rows_per_block - 1) / rows_per_block;
    gemv_kernel<T, MT, 2, KSPLIT, 5><<<grid, kGemvThreads, 0, stream>>>(x, wg, wu, h, gate, up, m, I, K);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  {
    constexpr int KSPLIT = 4;
    const int rows_per_block = (kGemvThreads / 32) / KSPLIT;
    const int grid = (H + rows_per_block - 1) / rows_per_block;
    gemv_kernel<T, MT, 1, KSPLIT, 5><<<grid, kGemvThreads, 0, stream>>>(h, wd, nullptr, out, nullptr, nullptr, m, H,
                                                                        I);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// out [m, H]; h [m, I]; gate/up [m, I] or undefined.
void gemv_path(const at::Tensor& x2d, const at::Tensor& w_gate, const at::Tensor& w_up, const at::Tensor& w_down,
               at::Tensor& out, at::Tensor& h, at::Tensor* gate, at::Tensor* up) {
  const int m = static_cast<int>(x2d.size(0)), K = static_cast<int>(x2d.size(1));
  const int I = static_cast<int>(w_gate.size(0)), H = static_cast<int>(w_down.size(0));
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  G4OPS_DISPATCH_HALF_BF16(x2d.scalar_type(), "g4ops.geglu_mlp", [&] {
    using T = scalar_t;
    const T* xp = reinterpret_cast<const T*>(x2d.data_ptr());
    const T* wg = reinterpret_cast<const T*>(w_gate.data_ptr());
    const T* wu = reinterpret_cast<const T*>(w_up.data_ptr());
    const T* wd = reinterpret_cast<const T*>(w_down.data_ptr());
    T* hp = reinterpret_cast<T*>(h.data_ptr());
    T* gp = gate != nullptr ? reinterpret_cast<T*>(gate->data_ptr()) : nullptr;
    T* upp = up != nullptr ? reinterpret_cast<T*>(up->data_ptr()) : nullptr;
    T* op = reinterpret_cast<T*>(out.data_ptr());
    if (m == 1) launch_gemv_pair<T, 1>(xp, wg, wu, wd, hp, gp, upp, op, m, I, K, H, stream);
    else if (m == 2) launch_gemv_pair<T, 2>(xp, wg, wu, wd, hp, gp, upp, op, m, I, K, H, stream);
    else if (m <= 4) launch_gemv_pair<T, 4>(xp, wg, wu, wd, hp, gp, upp, op, m, I, K, H, stream);
    else launch_gemv_pair<T, 8>(xp, wg, wu, wd, hp, gp, upp, op, m, I, K, H, stream);
  });
}

// Shared forward. Returns out (x.shape[:-1] + [H]); fills gate/up (x.shape[:-1] + [I]) when asked.
at::Tensor geglu_forward_impl(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
                              const at::Tensor& w_down, at::Tensor* gate_out, at::Tensor* up_out) {
  const int64_t K = x.size(-1), I = w_gate.size(0), H = w_down.size(0);
  const auto opts = x.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor x2d = as_rows(x);
  const int64_t m = x2d.size(0);
  if (gemv_eligible(x2d, w_gate, w_up, w_down)) {
    x2d = x2d.contiguous();
    if (aligned_to(x2d.data_ptr(), 16)) {
      at::Tensor out = at::empty({m, H}, opts);
      at::Tensor h = at::empty({m, I}, opts);
      at::Tensor g, u;
      if (gate_out != nullptr) {
        g = at::empty({m, I}, opts);
        u = at::empty({m, I}, opts);
      }
      gemv_path(x2d, w_gate, w_up, w_down, out, h, gate_out ? &g : nullptr, up_out ? &u : nullptr);
      if (gate_out != nullptr) {
        *gate_out = g.view(with_last(x, I));
        *up_out = u.view(with_last(x, I));
      }
      return out.view(with_last(x, H));
    }
  }
  at::Tensor g = at::mm(x2d, w_gate.t());
  at::Tensor u = at::mm(x2d, w_up.t());
  if (!g.is_contiguous()) g = g.contiguous();
  if (!u.is_contiguous()) u = u.contiguous();
  const at::Tensor h = geglu_rows(g, u);
  at::Tensor out = at::mm(h, w_down.t());
  if (!out.is_contiguous()) out = out.contiguous();
  if (gate_out != nullptr) {
    *gate_out = g.view(with_last(x, I));
    *up_out = u.view(with_last(x, I));
  }
  return out.view(with_last(x, H));
}

at::Tensor geglu_mlp_cuda(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
                          const at::Tensor& w_down) {
  check_geglu_inputs("geglu_mlp", x, w_gate, w_up, w_down);
  const c10::cuda::CUDAGuard guard(x.device());
  return geglu_forward_impl(x, w_gate, w_up, w_down, nullptr, nullptr);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> geglu_mlp_forward_cuda(const at::Tensor& x, const at::Tensor& w_gate,
                                                                      const at::Tensor& w_up,
                                                                      const at::Tensor& w_down) {
  check_geglu_inputs("geglu_mlp_forward", x, w_gate, w_up, w_down);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor gate, up;
  at::Tensor out = geglu_forward_impl(x, w_gate, w_up, w_down, &gate, &up);
  return {out, gate, up};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> geglu_mlp_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up,
    const at::Tensor& w_gate, const at::Tensor& w_up, const at::Tensor& w_down, std::array<bool, 4> output_mask) {
  check_geglu_inputs("geglu_mlp_backward", x, w_gate, w_up, w_down);
  const int64_t K = x.size(-1), I = w_gate.size(0), H = w_down.size(0);
  const auto inter_shape = with_last(x, I), out_shape = with_last(x, H);
  G4OPS_CHECK(grad_out.sizes() == at::IntArrayRef(out_shape), "g4ops.geglu_mlp_backward: `grad_out` must have shape ",
              at::IntArrayRef(out_shape), ", got ", grad_out.sizes());
  G4OPS_CHECK(gate.sizes() == at::IntArrayRef(inter_shape) && up.sizes() == at::IntArrayRef(inter_shape),
              "g4ops.geglu_mlp_backward: `gate` and `up` must have shape ", at::IntArrayRef(inter_shape), ", got ",
              gate.sizes(), " and ", up.sizes());
  const std::pair<const char*, const at::Tensor*> others[] = {{"grad_out", &grad_out}, {"gate", &gate}, {"up", &up}};
  for (const auto& nt : others) {
    G4OPS_CHECK(nt.second->scalar_type() == x.scalar_type(), "g4ops.geglu_mlp_backward: `", nt.first, "` is ",
                nt.second->scalar_type(), " but `x` is ", x.scalar_type());
    G4OPS_CHECK(nt.second->device() == x.device(), "g4ops.geglu_mlp_backward: `", nt.first, "` is on ",
                nt.second->device(), " but `x` is on ", x.device());
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const auto empty = at::empty({0}, x.options());
  const bool need_dg = output_mask[0] || output_mask[1];
  const bool need_du = output_mask[0] || output_mask[2];
  const bool need_h = output_mask[3];
  const at::Tensor x2d = as_rows(x);
  const at::Tensor go2 = as_rows(grad_out);
  const int64_t m = x2d.size(0);
  const auto opts = x.options().memory_format(at::MemoryFormat::Contiguous);

  at::Tensor dg, du, h;
  if (need_dg || need_du || need_h) {
    const at::Tensor g2 = gate.reshape({m, I}).contiguous();
    const at::Tensor u2 = up.reshape({m, I}).contiguous();
    at::Tensor dh;
    if (need_dg || need_du) {
      dh = at::mm(go2, w_down);
      if (!dh.is_contiguous()) dh = dh.contiguous();
    }
    if (need_dg) dg = at::empty({m, I}, opts);
    if (need_du) du = at::empty({m, I}, opts);
    if (need_h) h = at::empty({m, I}, opts);
    geglu_backward_rows(dh, g2, u2, dg, du, h);
  }

  // a fresh empty tensor per masked-off output: outputs must not alias each other (opcheck's test_schema)
  at::Tensor grad_x = empty, grad_wg = at::empty({0}, x.options()), grad_wu = at::empty({0}, x.options()),
             grad_wd = at::empty({0}, x.options());
  if (output_mask[0]) {
    at::Tensor gx = at::mm(dg, w_gate);
    if (!gx.is_contiguous()) gx = gx.contiguous();
    gx.addmm_(du, w_up);
    grad_x = gx.view(x.sizes());
  }
  if (output_mask[1]) grad_wg = at::mm(dg.t(), x2d).contiguous();
  if (output_mask[2]) grad_wu = at::mm(du.t(), x2d).contiguous();
  if (output_mask[3]) grad_wd = at::mm(go2.t(), h).contiguous();
  return {grad_x, grad_wg, grad_wu, grad_wd};
}

void check_gelu_tanh_mul_pair(const char* op, const at::Tensor& gate, const at::Tensor& up) {
  G4OPS_CHECK(gate.sizes() == up.sizes(), "g4ops.", op, ": `up` must have the shape of `gate` ", gate.sizes(),
              ", got ", up.sizes());
  G4OPS_CHECK(gate.scalar_type() == up.scalar_type(), "g4ops.", op, ": `up` is ", up.scalar_type(), " but `gate` is ",
              gate.scalar_type());
  G4OPS_CHECK(gate.is_cuda() && up.device() == gate.device(), "g4ops.", op,
              ": `gate` and `up` must be on one CUDA device");
}

// g4ops::gelu_tanh_mul: gelu_tanh(gate) * up, contiguous, in gate's shape. gate and up may be slices along a middle
// dim (row_matrix reads them in place).
at::Tensor gelu_tanh_mul_cuda(const at::Tensor& gate, const at::Tensor& up) {
  check_gelu_tanh_mul_pair("gelu_tanh_mul", gate, up);
  const c10::cuda::CUDAGuard guard(gate.device());
  return geglu_rows(row_matrix(gate), row_matrix(up)).view(gate.sizes());
}

// g4ops::gelu_tanh_mul_backward: (grad_gate, grad_up), contiguous; an output whose mask entry is false is empty.
std::tuple<at::Tensor, at::Tensor> gelu_tanh_mul_backward_cuda(const at::Tensor& grad_out, const at::Tensor& gate,
                                                               const at::Tensor& up, std::array<bool, 2> output_mask) {
  check_gelu_tanh_mul_pair("gelu_tanh_mul_backward", gate, up);
  G4OPS_CHECK(grad_out.sizes() == gate.sizes() && grad_out.scalar_type() == gate.scalar_type() &&
                  grad_out.device() == gate.device(),
              "g4ops.gelu_tanh_mul_backward: `grad_out` must match `gate` in shape, dtype and device");
  const c10::cuda::CUDAGuard guard(gate.device());
  const at::Tensor g = row_matrix(gate), u = row_matrix(up);
  const auto opts = gate.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor dg = output_mask[0] ? at::empty(g.sizes(), opts) : at::Tensor();
  at::Tensor du = output_mask[1] ? at::empty(g.sizes(), opts) : at::Tensor();
  at::Tensor none;
  if (output_mask[0] || output_mask[1]) geglu_backward_rows(grad_out.contiguous().view(g.sizes()), g, u, dg, du, none);
  return {output_mask[0] ? dg.view(gate.sizes()) : at::empty({0}, gate.options()),
          output_mask[1] ? du.view(gate.sizes()) : at::empty({0}, gate.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(g4ops, CUDA, m) {
  m.impl("geglu_mlp", &geglu_mlp_cuda);
  m.impl("geglu_mlp_forward", &geglu_mlp_forward_cuda);
  m.impl("geglu_mlp_backward", &geglu_mlp_backward_cuda);
  m.impl("gelu_tanh_mul", &gelu_tanh_mul_cuda);
  m.impl("gelu_tanh_mul_backward", &gelu_tanh_mul_backward_cuda);
}

}  // namespace g4ops
