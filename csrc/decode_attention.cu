// decode_attention.cu: CUDA kernels for g4ops::decode_attention, attention of one query token per sequence over a
// KV cache, grouped-query without repeating K/V.
//
// Semantics (the contract is g4ops/ops/reference.py `decode_attention`). q [B, Hq, 1, D], k and v [B, Hkv, S, D], mask
// bool [B or 1, 1, 1, S]; query head h reads KV head h / G, G = Hq / Hkv (transformers' repeat_kv order). In the
// accumulation type A (float; double for double inputs), over the visible keys s (mask true):
//   score_s = (sum_d q_d k_sd) * scale,   m = max_s score_s
//   out     = sum_s exp(score_s - m) v_s / sum_s exp(score_s - m)          rounded once to q's dtype
// A row without a visible key is 0. Masked keys are never read (unwritten cache slots may hold anything).
//
// Split-K ("flash-decoding"): two kernels on the current stream, an A workspace from the caching allocator, no host
// sync, so a CUDA graph captures the call.
//   split kernel, grid (splits, B * Hkv, head groups), 128 threads. A block takes `chunk` consecutive keys of one KV
//     head and GB query heads of it (all G when G <= 8), so K and V are read once for all of them. q (as A) and the
//     chunk's mask are staged in shared memory, and the visible keys' V rows are prefetched to L2. Scores: each warp
//     takes kKeyStep keys at a time (their loads in flight together), lanes split D into 16-byte vectors (scalar
//     when D or a K/V address or stride does not allow them), products summed in A and reduced by warp shuffles.
//     Per head: the chunk's max m, l = sum exp(score - m) and the partial output acc = sum exp(score - m) v_s, with
//     threads over D's vectors and, when D has fewer vectors than the block has threads, key groups summed through
//     shared memory in a fixed order. Written to the workspace: acc [B * Hq, splits, D] and (m, l)
//     [B * Hq, splits, 2]; a chunk without a visible key writes m = -inf, l = 0, acc = 0.
//   combine kernel, grid (B * Hq, D / 128): M = max_i m_i, out = sum_i exp(m_i - M) acc_i / sum_i exp(m_i - M) l_i,
//     in a fixed order (the result is deterministic), 0 when the denominator is 0.
// Every workspace and output element is written exactly once. Shapes whose shared memory or grid exceed the device's
// limits (a head dim of thousands with 8 query heads per KV head, B * Hkv > 65535) run the same math through ATen.

#include "g4ops_common.cuh"

#include <torch/library.h>

#include <limits>
#include <map>
#include <mutex>
#include <tuple>

namespace g4ops {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kKeyStep = 4;                    // keys a warp loads at once
constexpr int kMinChunk = kWarps * kKeyStep;   // chunks are multiples of this: every warp gets whole key steps
constexpr int kMaxChunk = 256;                 // bounds the score buffer; longer caches get more splits
constexpr int kMaxHeadsPerBlock = 8;
// Split target: one full wave, as many blocks as the device holds at once (the occupancy of the instantiation at
// hand; the bf16 GB=4 kernel uses 116 registers, so 4 blocks of 128 threads per SM), and never more unless the
// chunk bound forces it: a second, partly filled wave costs a whole block's latency again. H200, bf16, E4B shapes
// in CUDA graphs (2026-11-30): at batch 4 / 8 full layers took 30 / 40 us at 4 blocks per SM against 34 / 46 us
// at 2 and 40 / 49 us at 8 (two waves). The split count was once rounded up, which put batch 16 and 64 (B * Hkv =
// 32 and 128 rows of blocks) into a second wave of 16 and 112 blocks: the attention took 3.2 of the 11.2 ms batch-64
// step of 42 layers (2026-12-03).
constexpr int kCombineThreads = 128;

template <typename A>
__device__ __forceinline__ A warp_sum_acc(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename A>
__device__ __forceinline__ A warp_max_acc(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Max or sum of v over the block (blockDim.x a multiple of 32), in every thread; a fixed order: deterministic.
// `scratch` holds 32 values.
template <bool kMax, typename A>
__device__ __forceinline__ A block_reduce(A v, A* scratch) {
  v = kMax ? warp_max_acc(v) : warp_sum_acc(v);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  A r = scratch[0];
  for (int w = 1; w < int(blockDim.x >> 5); ++w) r = kMax ? fmax(r, scratch[w]) : r + scratch[w];
  __syncthreads();  // scratch may be reused
  return r;
}

__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

struct DecodeParams {
  int64_t q_sb, q_sh, q_sd;  // q strides (elements): batch, head, dim
  int64_t k_sb, k_sh, k_ss;  // k strides: batch, KV head, slot (dim stride 1)
  int64_t v_sb, v_sh, v_ss;
  int64_t m_sb, m_ss;        // mask strides: batch (0 when broadcast), slot
  int Hkv, G, S, D, chunk, splits;
};

// Shared memory of the split kernel, in bytes: q / key-group partials, scores, visibility flags.
template <typename A>
size_t split_smem_bytes(int heads_per_block, int D, int key_groups, int chunk) {
  return (size_t(key_groups) * heads_per_block * D + size_t(heads_per_block) * chunk) * sizeof(A) + size_t(chunk);
}

// No __launch_bounds__: with it, ptxas (CUDA 13.0, sm_90) capped several instantiations at 56-64 registers and
// spilled; without it none spills (the block is 128 threads, so any count up to 255 fits).
template <typename T, int GB, int VEC>
__global__ void decode_attention_split_kernel(const T* __restrict__ q,                           // [B, Hq, 1, D] any
                                              const T* __restrict__ k,                           // [B, Hkv, S, D]
                                              const T* __restrict__ v,                           // [B, Hkv, S, D]
                                              const bool* __restrict__ mask,                     // [B or 1, 1, 1, S]
                                              typename AccType<T>::type* __restrict__ part_acc,  // [B*Hq, splits, D]
                                              typename AccType<T>::type* __restrict__ part_ml,   // [B*Hq, splits, 2]
                                              const DecodeParams p, const typename AccType<T>::type scale) {
  using A = typename AccType<T>::type;
  using VecT = Vec<T, VEC>;
  using VecA = Vec<A, VEC>;
  constexpr A kNegInf = -std::numeric_limits<A>::infinity();

  const int split = blockIdx.x;
  const int b = blockIdx.y / p.Hkv, hk = blockIdx.y % p.Hkv;
  const int g0 = blockIdx.z * GB;
  const int heads = min(GB, p.G - g0);
  const int s0 = split * p.chunk;
  const int n = min(p.chunk, p.S - s0);
  const int D = p.D, nvec = D / VEC;
  const int key_groups = max(1, kThreads / nvec);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  extern __shared__ __align__(32) unsigned char smem[];
  A* q_s = reinterpret_cast<A*>(smem);                          // [GB, D], later the partials [key_groups, GB, D]
  A* p_s = q_s + size_t(key_groups) * GB * D;                   // [GB, chunk]: scores, then exp(score - m)
  bool* vis_s = reinterpret_cast<bool*>(p_s + GB * p.chunk);    // [chunk]

  const int64_t row0 = (int64_t(b) * p.Hkv + hk) * p.G + g0;   // b * Hq + first query head of the block
  const T* qb = q + b * p.q_sb + (int64_t(hk) * p.G + g0) * p.q_sh;
  const T* kb = k + b * p.k_sb + hk * p.k_sh + s0 * p.k_ss;
  const T* vb = v + b * p.v_sb + hk * p.v_sh + s0 * p.v_ss;
  const bool* mb = mask + b * p.m_sb + s0 * p.m_ss;

  // q and the chunk's mask in one round trip; then the V rows of the visible keys start moving to L2 while K is
  // read (one 128-byte line per prefetch), so the weighted sum finds them there.
  for (int i = threadIdx.x; i < GB * D; i += kThreads) {
    const int g = i / D, d = i - g * D;
    q_s[i] = g < heads ? to_acc<A>(qb[g * p.q_sh + d * p.q_sd]) : A(0);
  }
  for (int s = threadIdx.x; s < n; s += kThreads) vis_s[s] = mb[s * p.m_ss];
  __syncthreads();
  const int lines = int((int64_t(D) * sizeof(T) + 127) / 128);
  for (int i = threadIdx.x; i < n * lines; i += kThreads) {
    const int s = i / lines;
    if (vis_s[s]) prefetch_l2(reinterpret_cast<const char*>(vb + s * p.v_ss) + (i - s * lines) * 128);
  }

  // Scores. The visibility test is warp-uniform: a masked key costs no load and no reduction.
  for (int s = warp * kKeyStep; s < n; s += kWarps * kKeyStep) {
    bool visible[kKeyStep];
    A dot[kKeyStep][GB];
#pragma unroll
    for (int u = 0; u < kKeyStep; ++u) {
      visible[u] = s + u < n && vis_s[s + u];
#pragma unroll
      for (int g = 0; g < GB; ++g) dot[u][g] = A(0);
    }
#pragma unroll 2  // D = 512 in 16-bit: both vectors of each key in flight together
    for (int c = lane; c < nvec; c += 32) {
      VecT kv[kKeyStep] = {};
#pragma unroll
      for (int u = 0; u < kKeyStep; ++u)
        if (visible[u]) kv[u] = load_vec<T, VEC>(kb + (s + u) * p.k_ss + c * VEC);
#pragma unroll
      for (int g = 0; g < GB; ++g) {
        const VecA qv = *reinterpret_cast<const VecA*>(q_s + g * D + c * VEC);
#pragma unroll
        for (int u = 0; u < kKeyStep; ++u)
#pragma unroll
          for (int j = 0; j < VEC; ++j) dot[u][g] += qv.v[j] * to_acc<A>(kv[u].v[j]);
      }
    }
#pragma unroll
    for (int u = 0; u < kKeyStep; ++u) {
      if (!visible[u]) continue;
#pragma unroll
      for (int g = 0; g < GB; ++g) dot[u][g] = warp_sum_acc(dot[u][g]);
    }
    if (lane == 0) {
#pragma unroll
      for (int u = 0; u < kKeyStep; ++u) {
        if (s + u >= n) continue;
#pragma unroll
        for (int g = 0; g < GB; ++g) p_s[g * p.chunk + s + u] = visible[u] ? dot[u][g] * scale : kNegInf;
      }
    }
  }
  __syncthreads();

  // Per head: the chunk's max and sum of exponentials; the scores become exp(score - m) (0 when masked).
  for (int g = warp; g < heads; g += kWarps) {
    A* ps = p_s + g * p.chunk;
    A m = kNegInf;
    for (int s = lane; s < n; s += 32) m = fmax(m, ps[s]);
    m = warp_max_acc(m);
    A l = A(0);
    for (int s = lane; s < n; s += 32) {
      const A e = m == kNegInf ? A(0) : exp(ps[s] - m);
      ps[s] = e;
      l += e;
    }
    l = warp_sum_acc(l);
    if (lane == 0) {
      A* ml = part_ml + ((row0 + g) * p.splits + split) * 2;
      ml[0] = m;
      ml[1] = l;
    }
  }
  __syncthreads();

  // Partial output: vector c of D over the keys kg, kg + key_groups, ... of the chunk, kKeyStep loads in flight.
  auto accumulate = [&](int c, int kg, VecA (&acc)[GB]) {
    for (int s = kg; s < n; s += key_groups * kKeyStep) {
      VecT vv[kKeyStep] = {};
#pragma unroll
      for (int u = 0; u < kKeyStep; ++u) {
        const int su = s + u * key_groups;
        if (su < n && vis_s[su]) vv[u] = load_vec<T, VEC>(vb + su * p.v_ss + c * VEC);
      }
#pragma unroll
      for (int u = 0; u < kKeyStep; ++u) {
        const int su = s + u * key_groups;
        if (su >= n) continue;
#pragma unroll
        for (int g = 0; g < GB; ++g) {
          const A pg = p_s[g * p.chunk + su];  // 0 for a masked key, whose vv is 0 too
#pragma unroll
          for (int j = 0; j < VEC; ++j) acc[g].v[j] += pg * to_acc<A>(vv[u].v[j]);
        }
      }
    }
  };
  A* out_base = part_acc + (row0 * p.splits + split) * D;  // head g's row is at + g * splits * D
  const int64_t head_step = int64_t(p.splits) * D;
  if (key_groups == 1) {
    for (int c = threadIdx.x; c < nvec; c += kThreads) {
      VecA acc[GB] = {};
      accumulate(c, 0, acc);
      for (int g = 0; g < heads; ++g) store_vec<A, VEC>(out_base + g * head_step + c * VEC, acc[g]);
    }
  } else {
    A* red_s = q_s;  // q is no longer read
    const int kg = threadIdx.x / nvec, c = threadIdx.x - kg * nvec;
    if (kg < key_groups) {
      VecA acc[GB] = {};
      accumulate(c, kg, acc);
#pragma unroll
      for (int g = 0; g < GB; ++g) store_vec<A, VEC>(red_s + (kg * GB + g) * D + c * VEC, acc[g]);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < heads * D; i += kThreads) {
      const int g = i / D, d = i - g * D;
      A t = A(0);
      for (int r = 0; r < key_groups; ++r) t += red_s[(r * GB + g) * D + d];
      out_base[g * head_step + d] = t;
    }
  }
}

// Grid (B * Hq, D / blockDim.x rounded up): one output element per thread. The splits' weights exp(m_i - M) are
// computed once per block into shared memory, so the weighted sum is a run of independent loads.
template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
decode_attention_combine_kernel(const typename AccType<T>::type* __restrict__ part_acc,  // [B * Hq, splits, D]
                                const typename AccType<T>::type* __restrict__ part_ml,   // [B * Hq, splits, 2]
                                T* __restrict__ out,                                     // [B * Hq, D]
                                int splits, int D) {
  using A = typename AccType<T>::type;
  constexpr A kNegInf = -std::numeric_limits<A>::infinity();
  extern __shared__ __align__(32) unsigned char smem[];
  A* w_s = reinterpret_cast<A*>(smem);  // [splits]
  A* scratch = w_s + splits;            // [32]
  const int64_t row = blockIdx.x;
  const A* ml = part_ml + row * splits * 2;
  A m_max = kNegInf;
  for (int i = threadIdx.x; i < splits; i += blockDim.x) m_max = fmax(m_max, ml[2 * i]);
  const A M = block_reduce<true>(m_max, scratch);
  A l_sum = A(0);
  for (int i = threadIdx.x; i < splits; i += blockDim.x) {
    const A m = ml[2 * i];
    const A w = m == kNegInf ? A(0) : exp(m - M);  // a split without a visible key wrote acc = 0 and weighs 0
    w_s[i] = w;
    l_sum += w * ml[2 * i + 1];
  }
  const A L = block_reduce<false>(l_sum, scratch);  // its syncs also publish w_s
  const int d = blockIdx.y * blockDim.x + threadIdx.x;
  if (d >= D) return;
  const A* acc = part_acc + row * splits * D + d;
  A o = A(0);
#pragma unroll 8
  for (int i = 0; i < splits; ++i) o += w_s[i] * acc[int64_t(i) * D];
  // L >= 1 when a key is visible (the split holding the max contributes l >= exp(0))
  out[row * D + d] = from_acc<T, A>(L > A(0) ? o / L : A(0));
}

// ---------------------------------------------------------------------------------------------------------------
// ATen path, for shapes beyond the kernels' limits. Same expressions as reference.decode_attention.

at::Tensor decode_attention_aten(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& mask, double scale) {
  const bool f64 = q.scalar_type() == at::kDouble;
  const auto acc = f64 ? at::kDouble : at::kFloat;
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(3), Hkv = k.size(1);
  const at::Tensor hidden = mask.logical_not();  // [B or 1, 1, 1, S]
  at::Tensor scores = at::matmul(q.to(acc).reshape({B, Hkv, Hq / Hkv, D}), k.to(acc).transpose(-1, -2)) * scale;
  scores = scores.masked_fill(hidden, -std::numeric_limits<double>::infinity());
  const double lowest = f64 ? std::numeric_limits<double>::lowest() : double(std::numeric_limits<float>::lowest());
  const at::Tensor p = (scores - scores.amax(-1, /*keepdim=*/true).clamp_min(lowest)).exp();
  const at::Tensor values = v.to(acc).masked_fill(hidden.transpose(-1, -2), 0.0);
  const at::Tensor out = at::matmul(p, values) / p.sum(-1, /*keepdim=*/true).clamp_min(1.0);
  return out.reshape({B, Hq, 1, D}).to(q.scalar_type()).contiguous();
}

// ---------------------------------------------------------------------------------------------------------------
// Checks of what the kernels rely on (ops/core.py checks everything first, with the same wording).

void check_decode_attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& mask) {
  const char* op = "g4ops.decode_attention";
  const auto dt = q.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kHalf || dt == at::kBFloat16 || dt == at::kFloat || dt == at::kDouble,
                   "g4ops: `q` must be float16, bfloat16, float32 or float64, got ", dt);
  TORCH_CHECK_TYPE(k.scalar_type() == dt && v.scalar_type() == dt, op, ": `k` and `v` must have `q`'s dtype ", dt,
                   ", got ", k.scalar_type(), " and ", v.scalar_type());
  TORCH_CHECK_TYPE(mask.scalar_type() == at::kBool, op, ": `mask` must be bool (True = attend), got ",
                   mask.scalar_type());
  G4OPS_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 4, op,
              ": `q`, `k`, `v` and `mask` must be 4-D, got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes(), ", ",
              mask.sizes());
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  G4OPS_CHECK(q.size(2) == 1, op, ": `q` must hold one query token per sequence [B, Hq, 1, D], got ", q.sizes());
  G4OPS_CHECK(k.size(0) == B && k.size(3) == D && Hkv >= 1 && S >= 1, op, ": `k` must be [", B,
              ", Hkv >= 1, S >= 1, ", D, "], got ", k.sizes());
  G4OPS_CHECK(Hq % Hkv == 0, op, ": the ", Hq, " query heads of `q` must be a multiple of the ", Hkv,
              " KV heads of `k`");
  G4OPS_CHECK(v.sizes() == k.sizes(), op, ": `v` must have the shape of `k` ", k.sizes(), ", got ", v.sizes());
  G4OPS_CHECK((mask.size(0) == 1 || mask.size(0) == B) && mask.size(1) == 1 && mask.size(2) == 1 &&
                  mask.size(3) == S,
              op, ": `mask` must be [", B, ", 1, 1, ", S, "] or [1, 1, 1, ", S, "], got ", mask.sizes());
  G4OPS_CHECK((k.stride(3) == 1 && v.stride(3) == 1) || D == 1, op,
              ": `k` and `v` must have a contiguous last dim (stride 1), got strides ", k.strides(), " and ",
              v.strides());
  G4OPS_CHECK(q.is_cuda(), op, ": the CUDA kernel got `q` on ", q.device());
  G4OPS_CHECK(k.device() == q.device() && v.device() == q.device() && mask.device() == q.device(), op,
              ": `k`, `v` and `mask` must be on `q`'s device ", q.device());
}

// ---------------------------------------------------------------------------------------------------------------
// Launchers.

template <typename T>
using SplitKernel = void (*)(const T*, const T*, const T*, const bool*, typename AccType<T>::type*,
                             typename AccType<T>::type*, const DecodeParams, const typename AccType<T>::type);

template <typename T, int GB>
SplitKernel<T> split_kernel_vec(int vec) {
  return vec == 1 ? decode_attention_split_kernel<T, GB, 1> : decode_attention_split_kernel<T, GB, 16 / sizeof(T)>;
}

template <typename T>
SplitKernel<T> split_kernel(int GB, int vec) {
  switch (GB) {
    case 1: return split_kernel_vec<T, 1>(vec);
    case 2: return split_kernel_vec<T, 2>(vec);
    case 4: return split_kernel_vec<T, 4>(vec);
    default: return split_kernel_vec<T, kMaxHeadsPerBlock>(vec);
  }
}

// Blocks of `kernel` an SM holds at once with `smem` bytes of dynamic shared memory each (at least 1). Asked of the
// runtime once per kernel, size and device, so a call inside a CUDA-graph capture (after its eager warm-up) makes
// no runtime query.
template <typename T>
int resident_blocks_per_sm(SplitKernel<T> kernel, size_t smem) {
  static std::mutex lock;
  static std::map<std::tuple<const void*, size_t, int>, int> known;
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), smem, int(c10::cuda::current_device()));
  const std::lock_guard<std::mutex> guard(lock);
  const auto hit = known.find(key);
  if (hit != known.end()) return hit->second;
  if (smem > 48 * 1024)  // beyond the default limit (only for head dims of thousands); set once per device
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, smem));
  return known[key] = std::max(blocks, 1);
}

// Returns false (nothing launched) for shapes beyond the kernels' shared memory or grid limits.
template <typename T>
bool decode_attention_kernels(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                              double scale, at::Tensor& out) {
  using A = typename AccType<T>::type;
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  const int64_t G = Hq / Hkv;
  const int GB = G == 1 ? 1 : G == 2 ? 2 : G <= 4 ? 4 : kMaxHeadsPerBlock;
  const int64_t groups = (G + GB - 1) / GB;
  if (B * Hkv > 65535 || groups > 65535 || S > INT32_MAX / 2 || D > INT32_MAX / kThreads ||
      (D + kCombineThreads - 1) / kCombineThreads > 65535)
    return false;

  constexpr int V = 16 / sizeof(T);
  const bool vec_ok = D % V == 0 && aligned_to(k.data_ptr(), 16) && aligned_to(v.data_ptr(), 16) &&
                      k.stride(0) % V == 0 && k.stride(1) % V == 0 && k.stride(2) % V == 0 &&
                      v.stride(0) % V == 0 && v.stride(1) % V == 0 && v.stride(2) % V == 0;
  const int vec = vec_ok ? V : 1;
  const int key_groups = static_cast<int>(std::max<int64_t>(1, kThreads / (D / vec)));

  // Chunk: the keys that fill one wave of blocks (see kMaxHeadsPerBlock's note), at least kMinChunk, at most
  // kMaxChunk. Rounding the chunk up to whole key steps only lowers the split count, so the wave is never exceeded
  // unless kMaxChunk forces it. The occupancy is taken at the largest chunk's shared memory (a lower bound).
  const SplitKernel<T> kernel = split_kernel<T>(GB, vec);
  const size_t max_smem = split_smem_bytes<A>(GB, static_cast<int>(D), key_groups, kMaxChunk);
  if (max_smem > at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin) return false;
  const int64_t wave = int64_t(resident_blocks_per_sm<T>(kernel, max_smem)) * num_sms();
  const int64_t want_splits = std::max<int64_t>(1, wave / (B * Hkv * groups));
  int64_t chunk = (S + want_splits - 1) / want_splits;
  chunk = std::min<int64_t>(kMaxChunk, std::max<int64_t>(kMinChunk, (chunk + kMinChunk - 1) / kMinChunk * kMinChunk));
  const int64_t splits = (S + chunk - 1) / chunk;
  const size_t smem = split_smem_bytes<A>(GB, static_cast<int>(D), key_groups, static_cast<int>(chunk));
  const size_t combine_smem = (size_t(splits) + 32) * sizeof(A);
  if (combine_smem > 48 * 1024) return false;

  DecodeParams p;
  p.q_sb = q.stride(0), p.q_sh = q.stride(1), p.q_sd = q.stride(3);
  p.k_sb = k.stride(0), p.k_sh = k.stride(1), p.k_ss = k.stride(2);
  p.v_sb = v.stride(0), p.v_sh = v.stride(1), p.v_ss = v.stride(2);
  p.m_sb = mask.size(0) == 1 ? 0 : mask.stride(0), p.m_ss = mask.stride(3);
  p.Hkv = static_cast<int>(Hkv), p.G = static_cast<int>(G), p.S = static_cast<int>(S), p.D = static_cast<int>(D);
  p.chunk = static_cast<int>(chunk), p.splits = static_cast<int>(splits);

  const int64_t acc_numel = B * Hq * splits * D;
  at::Tensor work = at::empty({acc_numel + B * Hq * splits * 2}, q.options().dtype(c10::CppTypeToScalarType<A>::value));
  A* part_acc = work.data_ptr<A>();
  A* part_ml = part_acc + acc_numel;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(B * Hkv), static_cast<unsigned>(groups));
  kernel<<<grid, kThreads, smem, stream>>>(
      reinterpret_cast<const T*>(q.data_ptr()), reinterpret_cast<const T*>(k.data_ptr()),
      reinterpret_cast<const T*>(v.data_ptr()), mask.data_ptr<bool>(), part_acc, part_ml, p, A(scale));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int threads = static_cast<int>(std::min<int64_t>(kCombineThreads, (D + 31) / 32 * 32));
  const dim3 combine_grid(static_cast<unsigned>(B * Hq), static_cast<unsigned>((D + threads - 1) / threads));
  decode_attention_combine_kernel<T><<<combine_grid, threads, combine_smem, stream>>>(
      part_acc, part_ml, reinterpret_cast<T*>(out.data_ptr()), p.splits, p.D);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

at::Tensor decode_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& mask, double scale) {
  check_decode_attention_inputs(q, k, v, mask);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty({q.size(0), q.size(1), 1, q.size(3)},
                             q.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  bool launched = false;
  G4OPS_DISPATCH_FLOATING(q.scalar_type(), "g4ops.decode_attention", [&] {
    launched = decode_attention_kernels<scalar_t>(q, k, v, mask, scale, out);
  });
  return launched ? out : decode_attention_aten(q, k, v, mask, scale);
}

}  // namespace

TORCH_LIBRARY_IMPL(g4ops, CUDA, m) {
  m.impl("decode_attention", &decode_attention_cuda);
}

}  // namespace g4ops
