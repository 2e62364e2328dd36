// Prefill attention on the tensor cores for CUDA builds with TVM's paged KV cache (bf16 / f16,
// head_dim 64 or 128): the prompt's tokens among themselves (`ragged`: K and V as the step wrote
// them) and against the pages a sequence already holds (`paged`).
//
// Why: TVM 0.27's TIR prefill kernels multiply on the CUDA cores, one 32-row tile of (rows x
// query heads of a group) a block, and read every key tile whatever the causal mask leaves: a
// 2048-token prompt of the Llama-3-8B shape took 268 ms against 56 ms with FlashInfer's kernels
// (which need flashinfer-python at build time) and 65 ms for transformers eager (H100).
//
// Scheme (FlashAttention-2): a thread block takes 64 query rows of one query head, 16 a warp; it
// walks the key tiles of 64 the causal mask reaches, each copied to shared memory by cp.async
// (K of the next tile while this one's P.V runs), S = Q.K^T and O += P.V on mma.sync m16n8k16 with
// float32 accumulation, and an online softmax in registers (base 2, as TVM's kernels keep it). P
// goes to the tensor cores in the compute dtype, as FlashInfer's does. A query head reads the K/V
// of its group's KV head (GQA). Rows of shared memory are padded by 16 bytes so that ldmatrix's
// eight rows fall in distinct banks.
//
// The contract is TVM's (relax/frontend/nn/llm/_prefill_kernels.py): output[row, head] = softmax
// over the unmasked keys of the row's sequence of (q . k * sm_scale) times V, with key `col` of a
// sequence visible to its query row `r` when col < kv_len (and, if causal, col < kv_len - q_len +
// r + 1); lse[row, head] = m + log2(sum) in base 2 with scores scaled by log2(e); a row that sees no
// key gets output 0 and lse -5e4 (TVM's "nothing here" value, which its state merge weighs as 0).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <cstdint>

namespace {

constexpr int kRows = 64;       // query rows a thread block (one query head)
constexpr int kKeys = 64;       // keys a tile
constexpr int kWarps = kRows / 16;
constexpr int kThreads = kWarps * 32;
constexpr int kPad = 8;         // elements of padding a shared-memory row (16 bytes)
constexpr int kPageSize = 16;   // TVM's paged KV cache page (the build's page_size)
constexpr float kEmptyLse = -5e4f;
constexpr int kMaxDevices = 64;
constexpr float kLog2e = 1.4426950408889634f;

template <typename T> struct Mma;
template <> struct Mma<__nv_bfloat16> {
  __device__ static void run(float* c, const uint32_t* a, const uint32_t* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  __device__ static uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  __device__ static __nv_bfloat16 cast(float x) { return __float2bfloat16_rn(x); }
};
template <> struct Mma<__half> {
  __device__ static void run(float* c, const uint32_t* a, const uint32_t* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  __device__ static uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  __device__ static __half cast(float x) { return __float2half_rn(x); }
};

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; `valid` false fills zeros (the source is not read).
__device__ __forceinline__ void CopyChunk(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SharedAddress(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void Commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void WaitPending() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void LoadMatrixX4(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(SharedAddress(p)));
}
__device__ __forceinline__ void LoadMatrixX4Trans(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(SharedAddress(p)));
}

// Where a sequence's keys and values are: contiguous rows (ragged) or 16-slot pages.
struct RaggedKV {
  const void* k;
  const void* v;
  const int32_t* kv_indptr;
  int64_t row_stride;  // elements from one key to the next: kv_heads * head_dim
  __device__ int Length(int b) const { return kv_indptr[b + 1] - kv_indptr[b]; }
  template <typename T>
  __device__ const T* Key(int b, int col, int kv_head, int d, bool value) const {
    const T* base = static_cast<const T*>(value ? v : k);
    return base + (static_cast<int64_t>(kv_indptr[b]) + col) * row_stride + static_cast<int64_t>(kv_head) * d;
  }
};

struct PagedKV {
  const void* pages;  // [pages, 2, kv_heads, 16, d]
  const int32_t* page_indptr;
  const int32_t* page_values;
  const int32_t* last_page_len;
  int kv_heads;
  __device__ int Length(int b) const {
    const int n = page_indptr[b + 1] - page_indptr[b];
    return n > 0 ? (n - 1) * kPageSize + last_page_len[b] : 0;
  }
  template <typename T>
  __device__ const T* Key(int b, int col, int kv_head, int d, bool value) const {
    const int64_t page = page_values[page_indptr[b] + col / kPageSize];
    const int64_t slot = ((page * 2 + (value ? 1 : 0)) * kv_heads + kv_head) * kPageSize + col % kPageSize;
    return static_cast<const T*>(pages) + slot * d;
  }
};

// Copies keys [col0, col0 + kKeys) of sequence b (K or V) into a padded shared tile; rows past
// the sequence's keys become zeros.
template <typename T, int D, typename KV>
__device__ __forceinline__ void LoadKeys(T* tile, const KV& kv, int b, int col0, int kv_len, int kv_head,
                                         bool value) {
  constexpr int kChunks = D / 8;  // 16-byte chunks a row
  for (int i = threadIdx.x; i < kKeys * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const bool valid = col0 + r < kv_len;
    // a row past the keys reads nothing (its page may not exist): any address does
    const void* src = valid ? static_cast<const void*>(kv.template Key<T>(b, col0 + r, kv_head, D, value) + c * 8)
                            : static_cast<const void*>(tile);
    CopyChunk(tile + r * (D + kPad) + c * 8, src, valid);
  }
}

struct Problem {
  const void* q;
  const int32_t* q_indptr;
  void* out;
  float* lse;
  int batch;
  int qo_heads;
  int group;  // query heads per KV head
  int causal;
  float scale;  // sm_scale * log2(e)
};

// The thread block's (sequence, tile) from blockIdx.x; tiles of a sequence run heaviest (last
// rows, most keys under the causal mask) first. False when the block has no tile.
__device__ __forceinline__ bool FindTile(const Problem& p, int* seq, int* row0) {
  int t = blockIdx.x;
  for (int b = 0; b < p.batch; ++b) {
    const int len = p.q_indptr[b + 1] - p.q_indptr[b];
    const int tiles = (len + kRows - 1) / kRows;
    if (t < tiles) {
      *seq = b;
      *row0 = (tiles - 1 - t) * kRows;
      return true;
    }
    t -= tiles;
  }
  return false;
}

template <typename T, int D, typename KV>
__global__ void __launch_bounds__(kThreads) PrefillKernel(Problem p, KV kv) {
  using M = Mma<T>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* q_tile = reinterpret_cast<T*>(smem_raw);
  T* k_tile = q_tile + kRows * (D + kPad);
  T* v_tile = k_tile + kKeys * (D + kPad);

  int b, row0;
  if (!FindTile(p, &b, &row0)) return;
  const int head = blockIdx.y, kv_head = head / p.group;
  const int q_begin = p.q_indptr[b], q_len = p.q_indptr[b + 1] - q_begin;
  const int kv_len = kv.Length(b);
  const int offset = kv_len - q_len;  // causal: row r sees col < offset + r + 1
  const int last_row = min(row0 + kRows, q_len) - 1;
  const int visible = p.causal ? min(kv_len, max(0, offset + last_row + 1)) : kv_len;
  const int n_tiles = (visible + kKeys - 1) / kKeys;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t4 = lane % 4;
  const T* q = static_cast<const T*>(p.q);

  // Q tile (rows past the sequence: zeros), then the first K tile.
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < kRows * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const bool valid = row0 + r < q_len;
    const T* src = q + (static_cast<int64_t>(q_begin + (valid ? row0 + r : 0)) * p.qo_heads + head) * D + c * 8;
    CopyChunk(q_tile + r * (D + kPad) + c * 8, src, valid);
  }
  if (n_tiles > 0) LoadKeys<T, D>(k_tile, kv, b, 0, kv_len, kv_head, false);
  Commit();

  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  uint32_t qf[D / 16][4];
  // this lane's two query rows, in the sequence's coordinates
  const int my_row[2] = {row0 + warp * 16 + g, row0 + warp * 16 + g + 8};

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int col0 = tile * kKeys;
    WaitPending<0>();
    __syncthreads();  // K (and on the first tile Q) are in shared memory
    if (tile == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const int mi = lane / 8;
        LoadMatrixX4(qf[kk], q_tile + (warp * 16 + lane % 8 + 8 * (mi % 2)) * (D + kPad) + kk * 16 + 8 * (mi / 2));
      }
    }
    LoadKeys<T, D>(v_tile, kv, b, col0, kv_len, kv_head, true);
    Commit();

    // S = Q K^T: 16 rows x 64 keys a warp, as 8 tiles of 8 keys.
    float s[kKeys / 8][4];
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int n = 0; n < kKeys / 8; n += 2) {
        uint32_t kb[4];
        const int mi = lane / 8;
        LoadMatrixX4(kb, k_tile + (n * 8 + lane % 8 + 8 * (mi / 2)) * (D + kPad) + kk * 16 + 8 * (mi % 2));
        M::run(s[n], qf[kk], kb);
        M::run(s[n + 1], qf[kk], kb + 2);
      }
    }

    // Mask, then the online softmax (base 2) for this lane's two rows.
    const bool edge = col0 + kKeys > kv_len || (p.causal && col0 + kKeys - 1 > offset + row0 + warp * 16);
    float row_max[2] = {m[0], m[1]};
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = col0 + n * 8 + 2 * t4 + (e & 1);
        const int r = my_row[e / 2];
        float x = s[n][e] * p.scale;
        if (edge && (col >= kv_len || (p.causal && col >= offset + r + 1))) x = -INFINITY;
        s[n][e] = x;
        row_max[e / 2] = fmaxf(row_max[e / 2], x);
      }
    }
    float rescale[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 1));
      row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 2));
      // a row that has seen only masked keys keeps m = -inf: its terms are 0 and nothing rescales
      const float base = row_max[h] == -INFINITY ? 0.f : row_max[h];
      rescale[h] = m[h] == -INFINITY ? 0.f : exp2f(m[h] - base);
      m[h] = row_max[h];
      row_max[h] = base;
      l[h] *= rescale[h];
    }
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      o[j][0] *= rescale[0]; o[j][1] *= rescale[0];
      o[j][2] *= rescale[1]; o[j][3] *= rescale[1];
    }
    uint32_t pf[kKeys / 16][4];
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) {
      const float p0 = exp2f(s[n][0] - row_max[0]), p1 = exp2f(s[n][1] - row_max[0]);
      const float p2 = exp2f(s[n][2] - row_max[1]), p3 = exp2f(s[n][3] - row_max[1]);
      l[0] += p0 + p1;
      l[1] += p2 + p3;
      // the accumulator of key tiles 2j, 2j+1 is the A operand of P.V's step j
      pf[n / 2][(n % 2) * 2 + 0] = M::pack(p0, p1);
      pf[n / 2][(n % 2) * 2 + 1] = M::pack(p2, p3);
    }

    WaitPending<0>();
    __syncthreads();  // V is in shared memory; every warp is done with K
    if (tile + 1 < n_tiles) {
      LoadKeys<T, D>(k_tile, kv, b, col0 + kKeys, kv_len, kv_head, false);
      Commit();
    }
    // O += P V: 16 rows x D a warp.
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
#pragma unroll
      for (int n = 0; n < D / 8; n += 2) {
        uint32_t vb[4];
        const int mi = lane / 8;
        LoadMatrixX4Trans(vb, v_tile + (kk * 16 + lane % 8 + 8 * (mi % 2)) * (D + kPad) + n * 8 + 8 * (mi / 2));
        M::run(o[n], pf[kk], vb);
        M::run(o[n + 1], pf[kk], vb + 2);
      }
    }
    __syncthreads();  // every warp is done with V before the next tile's copy
  }
  WaitPending<0>();

  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    const int r = my_row[h];
    if (r >= q_len) continue;
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    const int64_t row = static_cast<int64_t>(q_begin + r) * p.qo_heads + head;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      const int d = j * 8 + 2 * t4;
      out[row * D + d] = M::cast(o[j][2 * h] * inv);
      out[row * D + d + 1] = M::cast(o[j][2 * h + 1] * inv);
    }
    if (t4 == 0) p.lse[row] = l[h] > 0.f ? m[h] + log2f(l[h]) : kEmptyLse;
  }
}

void* Data(const tvm::ffi::TensorView& t) { return static_cast<char*>(t.data_ptr()) + t.byte_offset(); }

bool IsInt32(const tvm::ffi::TensorView& t) { return t.dtype().code == kDLInt && t.dtype().bits == 32; }

template <typename KV>
void Launch(const char* name, const tvm::ffi::TensorView& q, const tvm::ffi::TensorView& q_indptr,
            const tvm::ffi::TensorView& out, const tvm::ffi::TensorView& lse, int kv_heads, int causal,
            double sm_scale, const KV& kv) {
  TVM_FFI_ICHECK(q.ndim() == 3 && out.ndim() == 3 && lse.ndim() == 2) << name << ": expected q/output [tokens, heads, d]";
  TVM_FFI_ICHECK(q.IsContiguous() && out.IsContiguous() && lse.IsContiguous()) << name << ": q, output, lse must be contiguous";
  TVM_FFI_ICHECK(IsInt32(q_indptr) && q_indptr.ndim() == 1 && q_indptr.size(0) >= 1) << name << ": q_indptr must be int32 [batch + 1]";
  const int64_t tokens = q.size(0), heads = q.size(1), d = q.size(2);
  TVM_FFI_ICHECK(out.size(0) == tokens && out.size(1) == heads && out.size(2) == d && lse.size(0) == tokens &&
                 lse.size(1) == heads) << name << ": q, output and lse disagree in shape";
  TVM_FFI_ICHECK(kv_heads > 0 && heads % kv_heads == 0) << name << ": " << heads << " query heads over " << kv_heads << " KV heads";
  TVM_FFI_ICHECK(lse.dtype().code == kDLFloat && lse.dtype().bits == 32) << name << ": lse must be float32";
  const bool bf16 = q.dtype().code == kDLBfloat && q.dtype().bits == 16;
  const bool f16 = q.dtype().code == kDLFloat && q.dtype().bits == 16;
  TVM_FFI_ICHECK(bf16 || f16) << name << ": q must be bfloat16 or float16";
  TVM_FFI_ICHECK(d == 64 || d == 128) << name << ": head_dim " << d << " (kernels for 64 and 128)";
  TVM_FFI_ICHECK(tokens < (1LL << 31) / heads) << name << ": too many tokens";
  const int batch = static_cast<int>(q_indptr.size(0) - 1);
  if (tokens == 0 || batch == 0) return;
  Problem p{Data(q), static_cast<const int32_t*>(Data(q_indptr)), Data(out), static_cast<float*>(Data(lse)),
            batch, static_cast<int>(heads), static_cast<int>(heads / kv_heads), causal,
            static_cast<float>(sm_scale) * kLog2e};
  // every sequence's tiles: at most tokens / 64 + one partial tile each
  const dim3 grid(static_cast<unsigned>((tokens + kRows - 1) / kRows + batch), static_cast<unsigned>(heads));
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, q.device().device_id));
  int device = 0;
  TVM_FFI_ICHECK(cudaGetDevice(&device) == cudaSuccess && device >= 0 && device < kMaxDevices) << name << ": no CUDA device";
  // more than 48 KiB of shared memory (D = 128) is opt-in, per kernel and device: asked once each
#define VTOOL_PREFILL(T, D)                                                                               \
  {                                                                                                       \
    constexpr int bytes = (kRows + 2 * kKeys) * (D + kPad) * static_cast<int>(sizeof(T));                 \
    static bool opted_in[kMaxDevices] = {};                                                               \
    if (!opted_in[device]) {                                                                              \
      const cudaError_t attr =                                                                            \
          cudaFuncSetAttribute(PrefillKernel<T, D, KV>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes); \
      TVM_FFI_ICHECK(attr == cudaSuccess) << name << ": " << cudaGetErrorString(attr);                    \
      opted_in[device] = true;                                                                            \
    }                                                                                                     \
    PrefillKernel<T, D, KV><<<grid, kThreads, bytes, stream>>>(p, kv);                                     \
  }
  if (bf16 && d == 64) VTOOL_PREFILL(__nv_bfloat16, 64)
  else if (bf16) VTOOL_PREFILL(__nv_bfloat16, 128)
  else if (d == 64) VTOOL_PREFILL(__half, 64)
  else VTOOL_PREFILL(__half, 128)
#undef VTOOL_PREFILL
  const cudaError_t err = cudaGetLastError();
  TVM_FFI_ICHECK(err == cudaSuccess) << name << ": launch failed: " << cudaGetErrorString(err);
}

// batch_prefill_ragged_kv's tensors: q [tokens, qo_heads, d], k/v [kv_tokens, kv_heads, d].
void PrefillRagged(tvm::ffi::TensorView q, tvm::ffi::TensorView q_indptr, tvm::ffi::TensorView k,
                   tvm::ffi::TensorView v, tvm::ffi::TensorView kv_indptr, tvm::ffi::TensorView out,
                   tvm::ffi::TensorView lse, int64_t causal, double sm_scale) {
  constexpr const char* name = "vtool_prefill_ragged";
  TVM_FFI_ICHECK(k.ndim() == 3 && v.ndim() == 3 && k.IsContiguous() && v.IsContiguous() && k.size(1) == v.size(1) &&
                 k.size(2) == q.size(2) && v.size(2) == q.size(2) && k.size(0) == v.size(0))
      << name << ": k and v must be contiguous [tokens, kv_heads, d]";
  TVM_FFI_ICHECK(k.dtype() == q.dtype() && v.dtype() == q.dtype()) << name << ": q, k, v differ in dtype";
  TVM_FFI_ICHECK(IsInt32(kv_indptr) && kv_indptr.ndim() == 1 && kv_indptr.size(0) == q_indptr.size(0))
      << name << ": kv_indptr must be int32 [batch + 1]";
  const RaggedKV kv{Data(k), Data(v), static_cast<const int32_t*>(Data(kv_indptr)), k.size(1) * k.size(2)};
  Launch(name, q, q_indptr, out, lse, static_cast<int>(k.size(1)), static_cast<int>(causal), sm_scale, kv);
}

// batch_prefill_paged_kv's tensors: pages [num_pages, 2, kv_heads, 16, d], the step's page table
// (page_indptr [batch + 1], page_values [nnz]) and each sequence's last page fill.
void PrefillPaged(tvm::ffi::TensorView q, tvm::ffi::TensorView q_indptr, tvm::ffi::TensorView pages,
                  tvm::ffi::TensorView page_indptr, tvm::ffi::TensorView page_values,
                  tvm::ffi::TensorView last_page_len, tvm::ffi::TensorView out, tvm::ffi::TensorView lse,
                  int64_t causal, double sm_scale) {
  constexpr const char* name = "vtool_prefill_paged";
  TVM_FFI_ICHECK(pages.ndim() == 5 && pages.IsContiguous() && pages.size(1) == 2 && pages.size(3) == kPageSize &&
                 pages.size(4) == q.size(2) && pages.dtype() == q.dtype())
      << name << ": pages must be contiguous [pages, 2, kv_heads, 16, d] of q's dtype";
  TVM_FFI_ICHECK(IsInt32(page_indptr) && IsInt32(page_values) && IsInt32(last_page_len) &&
                 page_indptr.size(0) == q_indptr.size(0) && last_page_len.ndim() == 1 &&
                 last_page_len.size(0) == q_indptr.size(0) - 1)
      << name << ": page_indptr [batch + 1], page_values, last_page_len [batch] must be int32";
  const PagedKV kv{Data(pages), static_cast<const int32_t*>(Data(page_indptr)),
                   static_cast<const int32_t*>(Data(page_values)), static_cast<const int32_t*>(Data(last_page_len)),
                   static_cast<int>(pages.size(2))};
  Launch(name, q, q_indptr, out, lse, static_cast<int>(pages.size(2)), static_cast<int>(causal), sm_scale, kv);
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(vtool_prefill_ragged, PrefillRagged);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(vtool_prefill_paged, PrefillPaged);

// The TIR dispatchers (schedules/cuda/prefill_attention.py) reach these through T.call_cpacked, which
// calls a symbol outside the module by its plain name with the packed calling convention.
extern "C" {
TVM_FFI_DLL_EXPORT int vtool_prefill_ragged(void* self, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result) {
  return __tvm_ffi_vtool_prefill_ragged(self, args, num_args, result);
}
TVM_FFI_DLL_EXPORT int vtool_prefill_paged(void* self, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result) {
  return __tvm_ffi_vtool_prefill_paged(self, args, num_args, result);
}
}
