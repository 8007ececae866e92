// softcap_xent.cu: the elementwise part of g4ops.linear_cross_entropy (g4ops/ops/loss.py) as one CUDA kernel, the
// internal op g4ops_kernels::softcap_xent_rows. Internal: CUDA only, no autograd, no fake kernel; ops/loss.py calls
// it on each chunk's logits (a fresh GEMM output) instead of the Inductor-compiled `_chunk_loss` / `_chunk_loss_grad`.
//
// Semantics, per row r of logits x [n, V] (fp16/bf16/fp32, last dim contiguous, any row stride), all math in fp32:
//   t_j = tanh(x_j * (1/cap)),  z_j = t_j * cap          (z_j = x_j when cap == 0)
//   lse[r]      = logsumexp_j z_j                         (shift = the row max, or 0 where it is +-inf, as
//                                                          torch.logsumexp does)
//   row_loss[r] = valid[r] ? lse[r] - z[safe[r]] : 0
//   with row_scale (fp32 [n]): x is overwritten IN PLACE with
//   d_j = cast( ((exp(z_j - lse) - [j == safe[r] and valid[r]]) * row_scale[r]) * (1 - t_j^2 if cap else 1) )
//   (ops/loss.py's `_grad_from`, one rounding to the logits dtype); without row_scale x is only read.
// x * (1/cap) with 1/cap rounded to fp32 is what ATen's CUDA `z / cap` computes for a scalar `cap` (it multiplies
// by the reciprocal); z = t * cap is rounded before z - lse (__fmul_rn: no FMA contraction), as the Python helpers
// round it. tanhf / expf / logf are the accurate CUDA functions (max 2 ulp), never the __expf-style intrinsics.
//
// One CTA per row (grid-stride over rows), two passes over the row:
//   pass 1: each thread keeps a running max m and the sum s of exp(z - m) (rescaled when m grows; once per 16-byte
//           vector), then a block reduction of the (m, s) pairs gives lse; thread 0 writes lse and row_loss (it reads
//           x[safe] before the reduction's barrier, so before any thread of the row can overwrite it);
//   pass 2 (row_scale given): recomputes z and t and writes d over x. It walks the row from its end: the end was
//           read last in pass 1, so that part is the likeliest to still be in L2 (a 262144-word bf16 row is 512 KiB;
//           132 rows in flight on an H200 exceed its L2, so part of pass 2 reads DRAM again; not measured yet).
// Each row is split at its first 16-byte boundary: a scalar head (before it), 16-byte vectors, a scalar tail, so
// any V and any row start (odd V = 1031, a sliced view) get vector loads/stores, and every element is read in pass
// 1 and written in pass 2 by exactly one thread. No host sync; the current stream; n == 0 launches nothing.
// nvcc 13.0, sm_90, -Xptxas -v: 57 to 64 registers under the 1024-thread bound, no spills (four bf16 vectors in
// flight per thread spilled, hence two for 16-bit types; see xent_unroll).

#include "g4ops_common.cuh"

#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>

namespace g4ops {
namespace {

constexpr int kXentMaxThreads = 1024;
// 16-byte vectors in flight per thread per step: 16 elements either way (4 x fp32, 2 x fp16/bf16). Four bf16 vectors
// spilled registers under the 1024-thread launch bound (64 registers, nvcc 13.0).
template <typename T> constexpr int xent_unroll() { return sizeof(T) == 4 ? 4 : 2; }

// The shift of the exponentials for a running max m: m itself, or 0 where m is +-inf (torch.logsumexp's rule: a row
// of -inf gives -inf, a row holding +inf gives +inf, never NaN from inf - inf).
__device__ __forceinline__ float exp_shift(float m) { return fabsf(m) == INFINITY ? 0.f : m; }

// s (a sum of exp(z - from)) re-expressed against the shift `to` >= from. s == 0 stays 0 (no 0 * inf when the
// previous max was -inf).
__device__ __forceinline__ float rescaled(float s, float from, float to) {
  return s == 0.f ? 0.f : s * expf(from - to);
}

// (m, s) <- the pair for the union of both element sets.
__device__ __forceinline__ void merge_max_sum(float& m, float& s, float om, float os) {
  const float nm = fmaxf(m, om);
  const float to = exp_shift(nm);
  s = rescaled(s, exp_shift(m), to) + rescaled(os, exp_shift(om), to);
  m = nm;
}

// (m, s) merged across the 32 lanes of a warp: every lane ends with the warp's running max and rescaled sum.
__device__ __forceinline__ void warp_merge_max_sum(float& m, float& s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float om = __shfl_xor_sync(0xffffffffu, m, o);
    const float os = __shfl_xor_sync(0xffffffffu, s, o);
    merge_max_sum(m, s, om, os);
  }
}

// z (and t = tanh(x / cap) when capped) from a logit already converted to fp32.
template <bool CAP>
__device__ __forceinline__ float capped(float x, float cap, float inv_cap, float& t) {
  if (CAP) {
    t = tanhf(x * inv_cap);
    return __fmul_rn(t, cap);
  }
  t = 0.f;
  return x;
}

// Pass 1 on N values of one thread: fold them into the running (m, s).
template <bool CAP, int N>
__device__ __forceinline__ void accumulate(const float (&x)[N], float cap, float inv_cap, float& m, float& s) {
  float z[N];
  float vmax = -INFINITY;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float t;
    z[k] = capped<CAP>(x[k], cap, inv_cap, t);
    vmax = fmaxf(vmax, z[k]);
  }
  if (vmax > m) {  // rare after the first few vectors of a row
    s = rescaled(s, exp_shift(m), exp_shift(vmax));
    m = vmax;
  }
  const float sh = exp_shift(m);
#pragma unroll
  for (int k = 0; k < N; ++k) s += expf(z[k] - sh);
}

// Pass 2: d loss / d logit for element j (ops/loss.py's `_grad_from`, in its order of operations).
template <bool CAP>
__device__ __forceinline__ float grad_of(float x, bool is_label, float lse, float rs, float cap, float inv_cap) {
  float t;
  const float z = capped<CAP>(x, cap, inv_cap, t);
  const float p = expf(z - lse);
  float g = (p - (is_label ? 1.f : 0.f)) * rs;
  if (CAP) g = g * (1.f - t * t);
  return g;
}

template <typename T, int VEC, bool CAP>
__global__ void __launch_bounds__(kXentMaxThreads)
softcap_xent_kernel(T* __restrict__ logits,              // [n, V], row r at logits + r * row_stride
                    int64_t row_stride, int64_t V,
                    const int64_t* __restrict__ safe,    // [n] label per row, in [0, V)
                    const bool* __restrict__ valid,      // [n]
                    const float* __restrict__ row_scale, // [n] or nullptr (no pass 2)
                    float cap, float inv_cap,
                    float* __restrict__ lse_out,         // [n]
                    float* __restrict__ loss_out,        // [n]
                    int64_t n) {
  __shared__ float red_m[32], red_s[32];
  __shared__ float row_lse;
  constexpr int UNROLL = xent_unroll<T>();
  const int tid = threadIdx.x, nthreads = blockDim.x;  // blockDim.x: a multiple of 32
  const int lane = tid & 31, warp = tid >> 5, nwarps = nthreads >> 5;

  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    T* x = logits + row * row_stride;
    const int64_t label = safe[row];
    CUDA_KERNEL_ASSERT(label >= 0 && label < V);
    float x_label = 0.f;
    if (tid == 0) x_label = (label >= 0 && label < V) ? to_float(x[label]) : NAN;

    // head [0, head): up to the first 16-byte boundary; body: nvec vectors from there; tail [tail0, V)
    const uintptr_t mis = reinterpret_cast<uintptr_t>(x) % 16;
    const int64_t head = mis == 0 ? 0 : std::min<int64_t>(V, int64_t((16 - mis) / sizeof(T)));
    const int64_t nvec = (V - head) / VEC;
    const int64_t tail0 = head + nvec * VEC;
    const int nscalar = int(head + (V - tail0));  // <= 2 * (VEC - 1) < 32 <= nthreads
    const int64_t j_scalar = tid < head ? tid : tail0 + (tid - head);
    T* xb = x + head;  // 16-byte aligned

    // ---- pass 1: running (max, sum of exp) per thread
    float m = -INFINITY, s = 0.f;
    if (tid < nscalar) {
      const float xs[1] = {to_float(x[j_scalar])};
      accumulate<CAP, 1>(xs, cap, inv_cap, m, s);
    }
    for (int64_t base = tid; base < nvec; base += int64_t(nthreads) * UNROLL) {
      Vec<T, VEC> v[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int64_t i = base + int64_t(u) * nthreads;
        if (i < nvec) v[u] = load_vec<T, VEC>(xb + i * VEC);
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int64_t i = base + int64_t(u) * nthreads;
        if (i < nvec) {
          float xf[VEC];
#pragma unroll
          for (int k = 0; k < VEC; ++k) xf[k] = to_float(v[u].v[k]);
          accumulate<CAP, VEC>(xf, cap, inv_cap, m, s);
        }
      }
    }

    // ---- block reduction of (m, s) -> lse; thread 0 writes lse and the row's loss
    warp_merge_max_sum(m, s);
    if (lane == 0) {
      red_m[warp] = m;
      red_s[warp] = s;
    }
    __syncthreads();  // also: every thread has finished reading the row in pass 1 before pass 2 writes it
    if (warp == 0) {
      m = lane < nwarps ? red_m[lane] : -INFINITY;
      s = lane < nwarps ? red_s[lane] : 0.f;
      warp_merge_max_sum(m, s);
      if (lane == 0) {
        const float lse = logf(s) + exp_shift(m);
        float t;
        const float z_label = capped<CAP>(x_label, cap, inv_cap, t);
        lse_out[row] = lse;
        loss_out[row] = valid[row] ? lse - z_label : 0.f;
        row_lse = lse;
      }
    }
    __syncthreads();  // row_lse visible; red_m / red_s free again (the next row writes them after this barrier)
    if (row_scale == nullptr) continue;

    // ---- pass 2: d over x, from the row's end back to its start
    const float lse = row_lse;
    const float rs = row_scale[row];
    const int64_t lbl = valid[row] ? label : -1;
    if (tid < nscalar)
      x[j_scalar] = from_float<T>(grad_of<CAP>(to_float(x[j_scalar]), j_scalar == lbl, lse, rs, cap, inv_cap));
    for (int64_t base = nvec - 1 - tid; base >= 0; base -= int64_t(nthreads) * UNROLL) {
      Vec<T, VEC> v[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int64_t i = base - int64_t(u) * nthreads;
        if (i >= 0) v[u] = load_vec<T, VEC>(xb + i * VEC);
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int64_t i = base - int64_t(u) * nthreads;
        if (i >= 0) {
          const int64_t rel = lbl - (head + i * VEC);  // the label's position in this vector, if it is here
          const int k_label = rel >= 0 && rel < VEC ? int(rel) : -1;
          Vec<T, VEC> out;
#pragma unroll
          for (int k = 0; k < VEC; ++k)
            out.v[k] = from_float<T>(grad_of<CAP>(to_float(v[u].v[k]), k == k_label, lse, rs, cap, inv_cap));
          store_vec<T, VEC>(xb + i * VEC, out);
        }
      }
    }
  }
}

// Threads per row: enough for one UNROLL-vector step per thread to cover the row, rounded up to whole warps, at
// least a warp (the scalar head and tail need up to 14 threads), at most 1024 (E4B's 262144 words: 1024 threads,
// 16 steps of 16 elements each per pass) and what the compiled kernel allows.
template <typename T, int VEC, bool CAP>
void launch_softcap_xent(T* x, int64_t row_stride, int64_t V, const int64_t* safe, const bool* valid,
                         const float* row_scale, float cap, float inv_cap, float* lse, float* loss, int64_t n,
                         cudaStream_t stream) {
  constexpr int UNROLL = xent_unroll<T>();
  const auto kernel = softcap_xent_kernel<T, VEC, CAP>;
  const int limit = std::min(kXentMaxThreads, kernel_max_threads(reinterpret_cast<const void*>(kernel))) / 32 * 32;
  const int64_t want = (V / VEC + UNROLL - 1) / UNROLL;
  const int threads = static_cast<int>(std::max<int64_t>(32, std::min<int64_t>(limit, (want + 31) / 32 * 32)));
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(n, int64_t(1) << 30));
  kernel<<<grid, threads, 0, stream>>>(x, row_stride, V, safe, valid, row_scale, cap, inv_cap, lse, loss, n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> softcap_xent_rows_cuda(const at::Tensor& logits, const at::Tensor& safe_in,
                                                          const at::Tensor& valid_in,
                                                          const std::optional<at::Tensor>& row_scale_in, double cap) {
  constexpr const char* op = "g4ops_kernels.softcap_xent_rows";
  const auto dt = logits.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kHalf || dt == at::kBFloat16 || dt == at::kFloat, op,
                   ": `logits` must be float16, bfloat16 or float32 (float64 takes ops/loss.py's ATen path), got ", dt);
  G4OPS_CHECK(logits.is_cuda(), op, ": `logits` must be a CUDA tensor, got one on ", logits.device());
  G4OPS_CHECK(logits.dim() == 2, op, ": `logits` must be [rows, vocab], got ", logits.dim(), " dims");
  const int64_t n = logits.size(0), V = logits.size(1);
  G4OPS_CHECK(logits.stride(1) == 1 || V <= 1, op, ": `logits` must have a contiguous last dim, got its stride ",
              logits.stride(1));
  G4OPS_CHECK(n <= 1 || logits.stride(0) >= V, op, ": the rows of `logits` must not overlap (row stride ",
              logits.stride(0), " < vocab ", V, "): the kernel writes them in place");
  G4OPS_CHECK(n == 0 || V > 0, op, ": `logits` has rows but an empty vocabulary");
  G4OPS_CHECK(std::isfinite(cap) && cap >= 0.0, op, ": `cap` must be finite and >= 0 (0 = no softcap), got ", cap);
  TORCH_CHECK_TYPE(safe_in.scalar_type() == at::kLong, op, ": `safe` must be int64, got ", safe_in.scalar_type());
  TORCH_CHECK_TYPE(valid_in.scalar_type() == at::kBool, op, ": `valid` must be bool, got ", valid_in.scalar_type());
  const std::pair<const char*, const at::Tensor*> rows[] = {{"safe", &safe_in}, {"valid", &valid_in}};
  for (const auto& nt : rows) {
    G4OPS_CHECK(nt.second->dim() == 1 && nt.second->size(0) == n, op, ": `", nt.first, "` must have shape [", n,
                "] (one per row of `logits`), got ", nt.second->dim(), " dims of ",
                nt.second->numel(), " elements");
    G4OPS_CHECK(nt.second->device() == logits.device(), op, ": `", nt.first, "` is on ", nt.second->device(),
                " but `logits` is on ", logits.device());
  }
  if (row_scale_in.has_value()) {
    const at::Tensor& rs = *row_scale_in;
    TORCH_CHECK_TYPE(rs.scalar_type() == at::kFloat, op, ": `row_scale` must be float32, got ", rs.scalar_type());
    G4OPS_CHECK(rs.dim() == 1 && rs.size(0) == n, op, ": `row_scale` must have shape [", n, "], got ", rs.dim(),
                " dims of ", rs.numel(), " elements");
    G4OPS_CHECK(rs.device() == logits.device(), op, ": `row_scale` is on ", rs.device(), " but `logits` is on ",
                logits.device());
  }
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto fopts = logits.options().dtype(at::kFloat);
  at::Tensor lse = at::empty({n}, fopts);
  at::Tensor loss = at::empty({n}, fopts);
  if (n == 0) return {lse, loss};

  const at::Tensor safe = safe_in.contiguous();
  const at::Tensor valid = valid_in.contiguous();
  const at::Tensor row_scale = row_scale_in.has_value() ? row_scale_in->contiguous() : at::Tensor();
  const float cap_f = static_cast<float>(cap);
  const float inv_cap = cap_f > 0.f ? 1.0f / cap_f : 0.f;
  const int64_t row_stride = n == 1 ? V : logits.stride(0);
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  G4OPS_DISPATCH_HALF_BF16_FLOAT(dt, op, [&] {
    constexpr int VEC = 16 / sizeof(scalar_t);
    auto* x = reinterpret_cast<scalar_t*>(logits.data_ptr());
    const auto* sp = safe.data_ptr<int64_t>();
    const auto* vp = valid.data_ptr<bool>();
    const float* rp = row_scale.defined() ? row_scale.data_ptr<float>() : nullptr;
    float* lp = lse.data_ptr<float>();
    float* op_ = loss.data_ptr<float>();
    if (cap_f > 0.f) {
      launch_softcap_xent<scalar_t, VEC, true>(x, row_stride, V, sp, vp, rp, cap_f, inv_cap, lp, op_, n, stream);
    } else {
      launch_softcap_xent<scalar_t, VEC, false>(x, row_stride, V, sp, vp, rp, cap_f, inv_cap, lp, op_, n, stream);
    }
  });
  return {lse, loss};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(g4ops_kernels, m) {
  m.def("softcap_xent_rows(Tensor(a!) logits, Tensor safe, Tensor valid, Tensor? row_scale, float cap) -> "
        "(Tensor lse, Tensor row_loss)");
}

TORCH_LIBRARY_IMPL(g4ops_kernels, CUDA, m) {
  m.impl("softcap_xent_rows", &softcap_xent_rows_cuda);
}

}  // namespace g4ops
