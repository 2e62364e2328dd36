// Decode matmuls over weights kept in GGUF blocks, on the tensor cores (one row of x: a SIMT GEMV):
// out[m, n] = x[m, k] . dequant(W)[n, k]^T, x in bf16 or f16, out in float32, m up to 64 rows a
// launch (more: several launches).
//
// Why: the block GEMV (schedules/cuda/quantized_gemv.py) pays a multiply-add per weight per row
// of x, so a decode step of 32 sequences cost 4-10x one of a single sequence, and the prompt path
// (every weight dequantized into a temporary, then cuBLAS) writes and reads the whole model in
// bf16 again. Here each weight is read from its blocks once per step, dequantized in registers to
// the compute dtype and multiplied on the tensor cores (mma.sync m16n8k16, float32 accumulation),
// so the step's cost hardly grows with the rows of x.
//
// Layout (runtime/weights/ggml_blocks.py): qweight [n/4, k/32, 4, B] (B = 16 bytes of nibbles,
// byte j = element j | element j+16 << 4; Q8_0: 32 signed bytes), scales [n/4, k/32, 4] (Q4_K:
// d and dmin per 256, sub_scale and sub_min per 32; Q6_K: qhigh [n/4, k/64, 4, 16] with the high 2
// bits, d per 256, a signed sub_scale per 16).
//
// The weights are the mma's A operand (16 rows of W a tile), x the B operand (8 rows of x a tile),
// so a warp computes out^T for its weight rows and up to 64 rows of x. The sum over k does not
// care about the order of k, so it is permuted to suit the blocks: lane (g, q) of a warp
// (g = lane / 4, q = lane % 4) loads whole blocks, block b0 + q of weight rows g and g + 8, and for
// mma step s (0..7) supplies elements 4s..4s+3 of that block in the A slots of columns 2q, 2q+1,
// 2q+8, 2q+9; the same lane supplies x's elements 4s..4s+3 of the same block in the B slots of
// those k rows. For the nibble formats elements 4s..4s+3 are the low (s < 4) or high nibbles of
// bytes 4(s % 4)..4(s % 4)+3: one 32-bit word. The nibble formats form two weights at a time in the
// compute dtype (NibblePair: q d + c rounded once, d and c rounded to it first); Q8_0 and Q6_K
// form each as a float32 (a byte permute into the mantissa and one fused multiply-add, see
// Dequant), then the compute dtype: what the prompt path's dequantized temporary holds.
//
// A thread block: 4 warps of 32 weight rows (two mma tiles) each, all at the same k. Each step of
// 128 columns, its operands (the 128 rows' blocks, their scales, x's chunk) are copied by cp.async
// into one of three shared-memory stages two steps ahead (9-16 rows of 4-bit blocks: two, one
// ahead), and the lanes read their blocks from there (a version holding the next step's blocks
// in registers stayed latency-bound at 1.0-1.4 TB/s: too few loads in flight an SM). Matrices
// of few rows split the sum over k across blockIdx.y (models/quantized_linear.block_mma_splits):
// each split writes its own partial [m, n] and a second launch adds them in split order
// (deterministic, no atomics).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#ifndef VTOOL_BLOCK_MMA_KERNELS_ONLY  // tests/support/block_gemv_host.cu: the kernels' code alone
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#endif

#include <cstdint>
#include <cstring>
#include <string>

namespace {

constexpr int kTileRows = 4;   // ggml_blocks.TILE_ROWS
constexpr int kBlock = 32;     // weights per qweight block
constexpr int kGroup = 4;      // blocks per warp step, one per lane of a quad
// mma tiles of 16 weight rows a warp (1 tile and 8 warps a block measured no faster on the H200:
// fewer registers, but each warp reads x from shared memory for half the rows)
constexpr int kTiles = 2;
constexpr int kBlockRows = 128;            // weight rows of a thread block, all at the same k
constexpr int kWarps = kBlockRows / (16 * kTiles);
constexpr int kMaxRows = 64;   // rows of x a launch (8 mma tiles of 8)

enum class Fmt { kQ4_0, kQ4_1, kQ4_K, kQ8_0, kQ6_K };

struct Parts {
  const uint8_t* qweight;
  const __half* scale;      // d (Q4_K: per 256)
  const __half* min;        // Q4_1: m; Q4_K: dmin per 256
  const uint8_t* sub_scale; // Q4_K: sc per 32; Q6_K: signed sc per 16
  const uint8_t* qhigh;     // Q6_K: the high 2 bits, [n/4, k/64, 4, 16]
  const uint8_t* sub_min;   // Q4_K: m per 32
};

template <Fmt F>
__host__ __device__ constexpr int BlockBytes() { return F == Fmt::kQ8_0 ? 32 : 16; }

// One weight row's block: its quant words and the floats Dequant applies to each quant (Q6_K:
// one pair for its first 16 weights, one for the last 16, each with its own scale; `high` its
// high bits, at bit 4 * (block % 2) + 2 * (half) of each byte).
template <Fmt F>
struct RowBlock {
  uint32_t words[BlockBytes<F>() / 4];
  uint32_t high[F == Fmt::kQ6_K ? 4 : 1];
  float d, c, d_hi, c_hi;
  uint32_t d2, c2;  // the nibble formats: d and c as a pair of the compute dtype (NibblePair)
  int high_shift;
};

// The 4-bit formats take NibblePair: two weights at a time in the compute dtype.
template <Fmt F>
__host__ __device__ constexpr bool Nibbles() { return F == Fmt::kQ4_0 || F == Fmt::kQ4_1 || F == Fmt::kQ4_K; }

// Elements 4s..4s+3 of a row's block as four bytes of one word (byte i = element 4s + i), ready
// for Dequant: Q8_0's signed quants with their top bit flipped (q + 128); a nibble q as the byte
// 0x80 | q << 3, the top of the mantissa of 1 + q / 16 under the exponent byte 0x3F.
template <Fmt F, int S>
__device__ __forceinline__ uint32_t QuantBytes(const RowBlock<F>& r) {
  if constexpr (F == Fmt::kQ8_0) {
    return r.words[S] ^ 0x80808080u;
  } else if constexpr (F == Fmt::kQ6_K) {  // q = low nibble | high 2 bits << 4, as 0x80 | q << 1: 1 + q / 64
    const uint32_t low = (r.words[S % 4] >> (4 * (S / 4))) & 0x0F0F0F0Fu;
    const uint32_t high = (r.high[S % 4] >> (r.high_shift + 2 * (S / 4))) & 0x03030303u;
    return ((low | (high << 4)) << 1) | 0x80808080u;
  } else {
    return (((r.words[S % 4] >> (4 * (S / 4))) & 0x0F0F0F0Fu) << 3) | 0x80808080u;
  }
}

template <typename T>
__device__ __forceinline__ uint32_t Pack(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t Pack<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <>
__device__ __forceinline__ uint32_t Pack<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Byte i of `bytes` (from QuantBytes) as its weight, in float32: Q8_0 through the mantissa of
// 2^23 (2^23 + q + 128, less 2^23 + 128: exact), times d; a nibble's 1 + q / 16 (one byte
// permute) into one fused multiply-add. Either way what the prompt path's float32
// dequantization gives, but for the rounding of c - (16 + off) d (2^-24 of it) in the second.
template <Fmt F, int S>
__device__ __forceinline__ float Dequant(uint32_t bytes, int i, const RowBlock<F>& r) {
  if constexpr (F == Fmt::kQ8_0) {
    const float v = __int_as_float(static_cast<int>(__byte_perm(bytes, 0x4B000000u, 0x7540u | i)));
    return (v - 8388736.f) * r.d;
  } else {
    const float f = __int_as_float(static_cast<int>(__byte_perm(bytes, 0x3F000000u, 0x7044u | (i << 8))));
    if constexpr (F == Fmt::kQ6_K && S >= 4) return fmaf(f, r.d_hi, r.c_hi);  // the block's second 16
    return fmaf(f, r.d, r.c);
  }
}

// Elements 4s + 2h and 4s + 2h + 1 of a 4-bit row block as a pair of T, the A slots of one k pair:
// one byte permute puts the two bytes holding them 16 bits apart, one LOP3 keeps their nibbles
// and sets the exponent of M in T (bf16 128, f16 1024: where a unit in the last place is 1), so
// the pair reads M + q exactly; less M (Q4_0: M + 8) is q (q - 8) exactly, and one fused
// multiply-add with the block's d and c in T gives q d + c rounded once, in T. About 2
// instructions a weight where the float32 way (a byte permute and an FMA a weight, a conversion
// a pair, the nibbles' shifts and masks) took 3.4; the price is d and c rounded to T first (exact
// in f16 for Q4_0 and Q4_1, 2^-9 of them in bf16): a weight within about one more rounding of
// what the prompt path's float32 dequantization holds.
template <typename T>
struct Pair;
template <>
struct Pair<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static constexpr uint32_t kExponent = 0x43004300u;  // 128, 128
};
template <>
struct Pair<__half> {
  using T2 = __half2;
  static constexpr uint32_t kExponent = 0x64006400u;  // 1024, 1024
};

template <typename T2>
__device__ __forceinline__ T2 AsPair(uint32_t bits) {
  T2 v;
  memcpy(&v, &bits, 4);
  return v;
}
template <typename T2>
__device__ __forceinline__ uint32_t PairBits(T2 v) {
  uint32_t bits;
  memcpy(&bits, &v, 4);
  return bits;
}

template <typename T, Fmt F, int S, int H>
__device__ __forceinline__ uint32_t NibblePair(const RowBlock<F>& r) {
  using T2 = typename Pair<T>::T2;
  const uint32_t word = S < 4 ? r.words[S % 4] : r.words[S % 4] >> 4;  // low nibbles, or the high ones
  const uint32_t pair = __byte_perm(word, 0u, H == 0 ? 0x4140u : 0x4342u);
  uint32_t bits;  // (pair & mask) | exponent in one LOP3: nvcc spends two (an immediate each) on the C
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(bits) : "r"(pair), "r"(0x000F000Fu), "r"(Pair<T>::kExponent));
  constexpr uint32_t kOffset = Pair<T>::kExponent + (F == Fmt::kQ4_0 ? 0x00080008u : 0u);  // M + 8: 8 ulp more
  const T2 q = __hsub2(AsPair<T2>(bits), AsPair<T2>(kOffset));
  return PairBits(__hfma2(q, AsPair<T2>(r.d2), AsPair<T2>(r.c2)));
}

// c += A (16 x 16, row-major) . B (16 x 8, column-major) in float32; A and B in T (bf16 or f16).
template <typename T>
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

#define VTOOL_MMA(T, PTX_TYPE)                                                                           \
  template <>                                                                                            \
  __device__ __forceinline__ void Mma<T>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) { \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE                          \
                 ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                          \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                        \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                        \
  }
VTOOL_MMA(__nv_bfloat16, "bf16")
VTOOL_MMA(__half, "f16")
#undef VTOOL_MMA

// The x chunk of a warp step (kGroup blocks = 128 columns) for up to NT * 8 rows, in shared
// memory: each row's 256 bytes, then 16 bytes of padding so the lanes of a quad reading rows
// g = 0..7 fall in different banks.
constexpr int kChunk = kGroup * kBlock;       // columns of x a step
constexpr int kRowVecs = kChunk * 2 / 16 + 1;  // uint4 per staged row (bf16/f16), padded

// x's uint4 per staged chunk
template <int NT>
__host__ __device__ constexpr int XVecs() { return NT * 8 * (kChunk * 2 / 16); }
// A warp's weights for one step: kTiles mma tiles of 16 rows, rows g and g + 8 of each.
template <Fmt F>
struct WarpBlocks {
  RowBlock<F> r[kTiles][2];
};

// One mma step s of a warp step: A from each tile's rows g and g + 8, B from NT tiles of x.
template <typename T, Fmt F, int NT, int S>
__device__ __forceinline__ void Step(const WarpBlocks<F>& w, const uint4 (*xs)[kRowVecs], int g, int q,
                                     float (&acc)[kTiles][NT][4]) {
  uint32_t a[kTiles][4];
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    const RowBlock<F>& lo = w.r[t][0];
    const RowBlock<F>& hi = w.r[t][1];
    if constexpr (Nibbles<F>()) {
      a[t][0] = NibblePair<T, F, S, 0>(lo);  // row g, k rows 2q, 2q+1
      a[t][1] = NibblePair<T, F, S, 0>(hi);  // row g + 8
      a[t][2] = NibblePair<T, F, S, 1>(lo);  // row g, k rows 2q+8, 2q+9
      a[t][3] = NibblePair<T, F, S, 1>(hi);
      continue;
    }
    const uint32_t qlo = QuantBytes<F, S>(lo), qhi = QuantBytes<F, S>(hi);
    a[t][0] = Pack<T>(Dequant<F, S>(qlo, 0, lo), Dequant<F, S>(qlo, 1, lo));  // row g, k rows 2q, 2q+1
    a[t][1] = Pack<T>(Dequant<F, S>(qhi, 0, hi), Dequant<F, S>(qhi, 1, hi));  // row g + 8
    a[t][2] = Pack<T>(Dequant<F, S>(qlo, 2, lo), Dequant<F, S>(qlo, 3, lo));  // row g, k rows 2q+8, 2q+9
    a[t][3] = Pack<T>(Dequant<F, S>(qhi, 2, hi), Dequant<F, S>(qhi, 3, hi));
  }
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    // x row 8j + g, block q of the chunk, elements 4S..4S+3: 8 bytes at 64q + 8S
    const uint2 xv = reinterpret_cast<const uint2*>(xs[8 * j + g])[8 * q + S];
#pragma unroll
    for (int t = 0; t < kTiles; ++t) Mma<T>(acc[t][j], a[t], xv.x, xv.y);
  }
}

template <int Pending>
__device__ __forceinline__ void WaitX() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

// Every operand of a step (the 128 rows' blocks, their scales, x's chunk) is copied by cp.async
// into one of Stages() shared-memory stages, Stages() - 1 steps ahead, so an SM keeps its loads
// in flight without holding them in registers; the lanes then read their blocks from shared
// memory. Three stages, but two for the launches of 9-16 rows of x over 16-byte 4-bit blocks
// (Lean), whose registers are also capped for 5 blocks an SM (the kernel's __launch_bounds__): on
// an H100 their Q4_1 kernels ran 6-14% faster so, and an H200's 16-sequence 8B step 4.6%; the same
// rule for 1-8 or 32-64 rows made those steps 1-1.4% slower (two stages lose; at 32-64 rows the cap
// spills) (BENCHMARKS.md, session 47). Every other launch compiles as it did without the rule (a
// minimum of 0 blocks is no bound: the same SASS).
template <Fmt F, int NT>
__host__ __device__ constexpr bool Lean() {
  return NT == 2 && (F == Fmt::kQ4_0 || F == Fmt::kQ4_1 || F == Fmt::kQ4_K);
}
template <Fmt F, int NT>
__host__ __device__ constexpr int Stages() { return Lean<F, NT>() ? 2 : 3; }
constexpr int kBlockTiles = kBlockRows / kTileRows;  // 32 tiles of 4 rows

template <Fmt F>
__host__ __device__ constexpr int StageQ() { return kBlockTiles * kGroup * kTileRows * BlockBytes<F>(); }
// Q6_K's high bits: a step's 4 blocks are 2 groups of 64 weights, 16 bytes a row each
template <Fmt F>
__host__ __device__ constexpr int StageHigh() { return F == Fmt::kQ6_K ? kBlockTiles * 2 * kTileRows * 16 : 0; }
template <Fmt F>
__host__ __device__ constexpr int StageW() { return StageQ<F>() + StageHigh<F>(); }
constexpr int kStageScales = 2048;  // d, m (or Q4_K's d, dmin, sc, m) of a step
template <Fmt F, int NT>
__host__ __device__ constexpr int StageBytes() { return (StageW<F>() + kStageScales + NT * 8 * kRowVecs * 16 + 127) / 128 * 128; }

__device__ __forceinline__ void CpAsync(void* dst, const void* src, bool in, int bytes) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const int n = in ? bytes : 0;  // src-size 0 fills zeros
  if (bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(n));
  } else if (bytes == 8) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(d), "l"(src), "r"(n));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(n));
  }
}

// The pieces of a step each thread copies, fixed at compile time: kThreads threads walk a step's
// kBlockTiles * Pieces() 16-byte pieces of blocks with a stride of kThreads, so thread `tid` copies
// piece tid % Pieces() of tiles tid / Pieces() + i * (kThreads / Pieces()), i < WPieces(): its
// piece and block never change, only the tile, by a constant stride (x's vectors likewise). The
// runtime loops this replaced were unrolled by four with a remainder and recomputed every piece's
// 64-bit address from its tile and block (the step loop's SASS, Q4_1 at 32 rows: 974 instructions,
// remainder copies included, now 690 straight-line); the large matrices' kernels 3-14% faster on
// an H100 (BENCHMARKS.md, session 43).
constexpr int kThreads = kWarps * 32;
template <Fmt F>
__host__ __device__ constexpr int Pieces() { return kGroup * kTileRows * BlockBytes<F>() / 16; }  // a tile's step
template <Fmt F>
__host__ __device__ constexpr int WPieces() { return kBlockTiles * Pieces<F>() / kThreads; }      // a thread's step
constexpr int kHighPieces = 8;  // Q6_K: 2 groups x 4 rows x 16 bytes a tile's step

template <typename T, Fmt F, int NT>
__device__ __forceinline__ void IssueStep(const T* x, const Parts& p, char* st, int m, int n, int k, int grp) {
  static_assert(kThreads % Pieces<F>() == 0 && (kBlockTiles * Pieces<F>()) % kThreads == 0, "pieces per thread");
  const int kb = k / kBlock, tid = threadIdx.x;
  const int tiles = n / kTileRows, tile0 = blockIdx.x * kBlockTiles, b0 = grp * kGroup;
  {
    constexpr int kTileStride = kThreads / Pieces<F>();  // tiles between a thread's pieces
    const int piece = tid % Pieces<F>(), t0 = tid / Pieces<F>();
    const int blk = piece / (kTileRows * BlockBytes<F>() / 16);
    const bool blk_in = b0 + blk < kb;
    const int64_t tile_bytes = static_cast<int64_t>(kb) * kTileRows * BlockBytes<F>();
    const uint8_t* src = p.qweight + (tile0 + t0) * tile_bytes + static_cast<int64_t>(b0) * kTileRows * BlockBytes<F>() +
                         piece * 16;
    char* dst = st + (t0 * Pieces<F>() + piece) * 16;
#pragma unroll
    for (int i = 0; i < WPieces<F>(); ++i) {
      const bool in = blk_in && tile0 + t0 + i * kTileStride < tiles;
      CpAsync(dst + i * kTileStride * Pieces<F>() * 16, in ? src + i * kTileStride * tile_bytes : p.qweight, in, 16);
    }
  }
  if constexpr (F == Fmt::kQ6_K) {  // 2 groups x 4 rows x 16 bytes a tile, contiguous
    static_assert((kBlockTiles * kHighPieces) % kThreads == 0 && kThreads % kHighPieces == 0, "high pieces per thread");
    constexpr int kTileStride = kThreads / kHighPieces;
    const int piece = tid % kHighPieces, t0 = tid / kHighPieces;
    const int64_t tile_bytes = static_cast<int64_t>(kb / 2) * kTileRows * 16;
    const uint8_t* src = p.qhigh + (tile0 + t0) * tile_bytes + static_cast<int64_t>(b0 / 2) * kTileRows * 16 + piece * 16;
    char* dst = st + StageQ<F>() + (t0 * kHighPieces + piece) * 16;
#pragma unroll
    for (int i = 0; i < kBlockTiles * kHighPieces / kThreads; ++i) {
      const bool in = b0 < kb && tile0 + t0 + i * kTileStride < tiles;
      CpAsync(dst + i * kTileStride * kHighPieces * 16, in ? src + i * kTileStride * tile_bytes : p.qhigh, in, 16);
    }
  }
  char* sc = st + StageW<F>();
  if constexpr (F == Fmt::kQ6_K) {  // d of the super-block (8 bytes a tile), sc of the 8 chunks of 16 (32 a tile)
    if (tid < 2 * kBlockTiles) {
      const int t = tid / 2, half = tid % 2;
      const int64_t tile = tile0 + t;
      const bool in = tile < tiles && b0 < kb;
      CpAsync(sc + 512 + t * 32 + half * 16, p.sub_scale + (in ? (tile * (kb * 2) + b0 * 2) * kTileRows + half * 16 : 0),
              in, 16);
      if (half == 0) CpAsync(sc + t * 8, p.scale + (in ? (tile * (kb / 8) + b0 / 8) * kTileRows : 0), in, 8);
    }
  } else {  // one (tile, block) a thread: its 4 rows' scales
    const int t = tid / kGroup, blk = tid % kGroup;
    const int64_t tile = tile0 + t;
    const bool in = tile < tiles && b0 + blk < kb;
    const int64_t cell = in ? (tile * kb + b0 + blk) * kTileRows : 0;
    if constexpr (F == Fmt::kQ4_K) {
      CpAsync(sc + 512 + (t * kGroup + blk) * 4, p.sub_scale + cell, in, 4);
      CpAsync(sc + 1024 + (t * kGroup + blk) * 4, p.sub_min + cell, in, 4);
      if (tid < kBlockTiles) {  // d and dmin of the step's super-block, 4 rows a tile
        const int64_t tl = tile0 + tid;
        const bool tin = tl < tiles && b0 < kb;
        const int64_t sup = tin ? (tl * (kb / 8) + b0 / 8) * kTileRows : 0;
        CpAsync(sc + tid * 8, p.scale + sup, tin, 8);
        CpAsync(sc + 256 + tid * 8, p.min + sup, tin, 8);
      }
    } else {
      CpAsync(sc + (t * kGroup + blk) * 8, p.scale + cell, in, 8);
      if constexpr (F == Fmt::kQ4_1) CpAsync(sc + 1024 + (t * kGroup + blk) * 8, p.min + cell, in, 8);
    }
  }
  uint4 (*xs)[kRowVecs] = reinterpret_cast<uint4 (*)[kRowVecs]>(st + StageW<F>() + kStageScales);
  {
    constexpr int kVecs = kChunk * 2 / 16;  // uint4 of x a row a step
    static_assert(kThreads % kVecs == 0 && XVecs<NT>() % kThreads == 0, "x pieces per thread");
    constexpr int kRowStride = kThreads / kVecs;
    const int vec = tid % kVecs, r0 = tid / kVecs, col = grp * kChunk + vec * 8;
    const T* src = x + static_cast<int64_t>(r0) * k + col;
#pragma unroll
    for (int i = 0; i < XVecs<NT>() / kThreads; ++i) {
      const int row = r0 + i * kRowStride;
      const bool in = row < m && col < k;
      CpAsync(&xs[row][vec], in ? src + static_cast<int64_t>(i) * kRowStride * k : x, in, 16);
    }
  }
}

// Row R (of the thread block's 128) of block q of a step, from a stage.
template <typename T, Fmt F>
__device__ __forceinline__ void StagedRow(const char* st, int row, int q, RowBlock<F>& out) {
  const int t = row / kTileRows, r = row % kTileRows;
  const uint4* w = reinterpret_cast<const uint4*>(st + ((t * kGroup + q) * kTileRows + r) * BlockBytes<F>());
#pragma unroll
  for (int i = 0; i < BlockBytes<F>() / 16; ++i) {
    const uint4 v = w[i];
    out.words[4 * i] = v.x;
    out.words[4 * i + 1] = v.y;
    out.words[4 * i + 2] = v.z;
    out.words[4 * i + 3] = v.w;
  }
  const char* sc = st + StageW<F>();
  float d = 0.f, c = 0.f;
  if constexpr (F == Fmt::kQ6_K) {  // two scales a block (16 weights each), q - 32: w = f * 64D - 96D
    const uint4 h = reinterpret_cast<const uint4*>(st + StageQ<F>())[(t * 2 + q / 2) * kTileRows + r];
    out.high[0] = h.x;
    out.high[1] = h.y;
    out.high[2] = h.z;
    out.high[3] = h.w;
    out.high_shift = 4 * (q % 2);  // the block's place in its group of 64
    const float dd = __half2float(reinterpret_cast<const __half*>(sc)[t * kTileRows + r]);
    const int8_t* s16 = reinterpret_cast<const int8_t*>(sc + 512 + t * 32);
    const float lo = dd * static_cast<float>(s16[(2 * q) * kTileRows + r]);
    const float hi = dd * static_cast<float>(s16[(2 * q + 1) * kTileRows + r]);
    out.d = 64.f * lo;
    out.c = -96.f * lo;
    out.d_hi = 64.f * hi;
    out.c_hi = -96.f * hi;
    return;
  } else if constexpr (F == Fmt::kQ4_K) {
    const __half* dd = reinterpret_cast<const __half*>(sc);
    const __half* dm = reinterpret_cast<const __half*>(sc + 256);
    const int cell = (t * kGroup + q) * kTileRows + r;
    d = __half2float(dd[t * kTileRows + r]) * static_cast<float>(static_cast<const uint8_t*>(
        reinterpret_cast<const void*>(sc + 512))[cell]);
    c = -(__half2float(dm[t * kTileRows + r]) * static_cast<float>(static_cast<const uint8_t*>(
        reinterpret_cast<const void*>(sc + 1024))[cell]));
  } else {
    const int cell = (t * kGroup + q) * kTileRows + r;
    d = __half2float(reinterpret_cast<const __half*>(sc)[cell]);
    c = F == Fmt::kQ4_1 ? __half2float(reinterpret_cast<const __half*>(sc + 1024)[cell]) : 0.f;
  }
  if constexpr (Nibbles<F>()) {  // NibblePair's d and c, rounded to T once
    out.d2 = Pack<T>(d, d);
    out.c2 = Pack<T>(c, c);
  } else if constexpr (F == Fmt::kQ8_0) {
    out.d = d;
    out.c = 0.f;
  } else {
    out.d = 16.f * d;
    out.c = c - (F == Fmt::kQ4_0 ? 24.f : 16.f) * d;
  }
}

template <typename T, Fmt F, int NT>
__global__ void __launch_bounds__(kWarps * 32, Lean<F, NT>() ? 5 : 0)
    BlockMmaStaged(const T* __restrict__ x, Parts p, float* __restrict__ out, int m, int n, int k,
                   int64_t split_stride) {
  extern __shared__ uint4 smem_raw[];
  char* smem = reinterpret_cast<char*>(smem_raw);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, q = lane % 4;
  const int kb = k / kBlock, groups = (kb + kGroup - 1) / kGroup, splits = gridDim.y;
  const int first = static_cast<int>(static_cast<int64_t>(blockIdx.y) * groups / splits);
  const int last = static_cast<int>(static_cast<int64_t>(blockIdx.y + 1) * groups / splits);
  const int steps = last - first;

  float acc[kTiles][NT][4];
#pragma unroll
  for (int t = 0; t < kTiles; ++t)
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[t][j][0] = acc[t][j][1] = acc[t][j][2] = acc[t][j][3] = 0.f;

#pragma unroll
  for (int s = 0; s < Stages<F, NT>() - 1; ++s) {
    if (s < steps) IssueStep<T, F, NT>(x, p, smem + s * StageBytes<F, NT>(), m, n, k, first + s);
    asm volatile("cp.async.commit_group;\n" ::);
  }
  for (int i = 0; i < steps; ++i) {
    WaitX<Stages<F, NT>() - 2>();
    __syncthreads();  // step i is in its stage for every thread; every warp is done with step i - 1
    const int ahead = i + Stages<F, NT>() - 1;
    if (ahead < steps) IssueStep<T, F, NT>(x, p, smem + (ahead % Stages<F, NT>()) * StageBytes<F, NT>(), m, n, k, first + ahead);
    asm volatile("cp.async.commit_group;\n" ::);
    const char* st = smem + (i % Stages<F, NT>()) * StageBytes<F, NT>();
    WarpBlocks<F> w;
#pragma unroll
    for (int a = 0; a < kTiles; ++a) {
      StagedRow<T, F>(st, warp * 16 * kTiles + 16 * a + g, q, w.r[a][0]);
      StagedRow<T, F>(st, warp * 16 * kTiles + 16 * a + g + 8, q, w.r[a][1]);
    }
    const uint4 (*xs)[kRowVecs] = reinterpret_cast<const uint4 (*)[kRowVecs]>(st + StageW<F>() + kStageScales);
    Step<T, F, NT, 0>(w, xs, g, q, acc);
    Step<T, F, NT, 1>(w, xs, g, q, acc);
    Step<T, F, NT, 2>(w, xs, g, q, acc);
    Step<T, F, NT, 3>(w, xs, g, q, acc);
    Step<T, F, NT, 4>(w, xs, g, q, acc);
    Step<T, F, NT, 5>(w, xs, g, q, acc);
    Step<T, F, NT, 6>(w, xs, g, q, acc);
    Step<T, F, NT, 7>(w, xs, g, q, acc);
  }
  WaitX<0>();

  const int row0 = blockIdx.x * kBlockRows + warp * 16 * kTiles;
  float* o = out + blockIdx.y * split_stride;
#pragma unroll
  for (int t = 0; t < kTiles; ++t)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int wrow = row0 + 16 * t + g + (c / 2) * 8, xr = j * 8 + 2 * q + (c % 2);
        if (wrow < n && xr < m) o[static_cast<int64_t>(xr) * n + wrow] = acc[t][j][c];
      }
}

template <typename T, Fmt F, int NT>
void LaunchStaged(dim3 grid, dim3 block, cudaStream_t stream, const T* x, const Parts& p, float* out, int m, int n,
                  int k, int64_t split_stride) {
  constexpr int bytes = Stages<F, NT>() * StageBytes<F, NT>();
  static const cudaError_t set = cudaFuncSetAttribute(BlockMmaStaged<T, F, NT>,
                                                      cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  (void)set;  // a failure shows at the launch
  BlockMmaStaged<T, F, NT><<<grid, block, bytes, stream>>>(x, p, out, m, n, k, split_stride);
}

template <typename T, Fmt F>
void Launch(const T* x, const Parts& p, float* out, int m, int n, int k, int splits, cudaStream_t stream) {
  const dim3 grid((n + kBlockRows - 1) / kBlockRows, splits), block(kWarps * 32);
  const int64_t stride = static_cast<int64_t>(m) * n;
  for (int r0 = 0; r0 < m; r0 += kMaxRows) {
    const int rows = m - r0 < kMaxRows ? m - r0 : kMaxRows;
    const T* xs = x + static_cast<int64_t>(r0) * k;
    float* os = out + static_cast<int64_t>(r0) * n;  // row r0 of split 0's [m, n]
    if (rows <= 8) {
      LaunchStaged<T, F, 1>(grid, block, stream, xs, p, os, rows, n, k, stride);
    } else if (rows <= 16) {
      LaunchStaged<T, F, 2>(grid, block, stream, xs, p, os, rows, n, k, stride);
    } else if (rows <= 32) {
      LaunchStaged<T, F, 4>(grid, block, stream, xs, p, os, rows, n, k, stride);
    } else {
      LaunchStaged<T, F, 8>(grid, block, stream, xs, p, os, rows, n, k, stride);
    }
  }
}

// The sum of the splits' partial[y, i] (float4 i) in split order (deterministic). The splits'
// loads are issued kReduceBatch at a time before their adds, which keep the split order (the same
// sums bit for bit): with one float4 a thread at decode's row counts the kernel is a chain of L2
// round trips, one per two splits as nvcc unrolled the plain loop (~5 us a launch with 11-17 splits
// at 64 rows, 4 launches a layer), one per kReduceBatch splits now.
constexpr int kReduceBatch = 8;
__device__ __forceinline__ float4 SumSplits(const float4* __restrict__ partial, int splits, int64_t count4, int64_t i) {
  float4 s = partial[i];
  for (int y = 1; y < splits; y += kReduceBatch) {
    float4 v[kReduceBatch];
#pragma unroll
    for (int j = 0; j < kReduceBatch; ++j) {
      if (y + j < splits) v[j] = partial[(y + j) * count4 + i];
    }
#pragma unroll
    for (int j = 0; j < kReduceBatch; ++j) {
      if (y + j < splits) {
        s.x += v[j].x;
        s.y += v[j].y;
        s.z += v[j].z;
        s.w += v[j].w;
      }
    }
  }
  return s;
}

// What the matmul's caller does with its float32 result, done by the kernel that adds the splits
// instead of by a kernel of its own (a launch and a float32 round trip fewer a matmul; the graph
// rewrite is toolchain/block_mma_epilogues.py). Each one computes what TVM's generated kernel for
// the same Relax ops does, in the same order and the same type, so the values are the same bit
// for bit: the cast to the compute dtype T (round to nearest), a residual add in T, or Llama's
// gated MLP (gate = the first half of the columns, up = the second) as TVM's silu lowers:
// g * (1 / (1 + exp(0 - g))) * u, each operation rounded to T.
enum class Epilogue { kFloat, kCast, kCastAdd, kSiluMul };

// exp as TVM's CUDA code takes it: bf16 through float32's expf, f16 through cuda_fp16's hexp.
__device__ __forceinline__ __nv_bfloat16 Exp(__nv_bfloat16 v) {
  return static_cast<__nv_bfloat16>(expf(static_cast<float>(v)));
}
__device__ __forceinline__ __half Exp(__half v) { return hexp(v); }

template <typename T, Epilogue E>
__device__ __forceinline__ T Finish(float sum, float up, const T* residual, int64_t at) {
  const T v = static_cast<T>(sum);
  if constexpr (E == Epilogue::kCastAdd) {
    return residual[at] + v;
  } else if constexpr (E == Epilogue::kSiluMul) {
    const T one = static_cast<T>(1.f);
    const T e = Exp(static_cast<T>(0.f) - v);
    return v * (one / (one + e)) * static_cast<T>(up);
  } else {
    return v;
  }
}

// out[i] = the sum of the splits, 4 floats a thread (E == kFloat), or Finish of it in T: out is
// [m, n] (kSiluMul: [m, n / 2], gate sums at columns c, up at c + n / 2 of the same row).
template <typename T, Epilogue E>
__global__ void ReduceSplits(const float4* __restrict__ partial, void* __restrict__ out, const T* __restrict__ residual,
                             int splits, int64_t count4, int n) {
  const int64_t out4 = E == Epilogue::kSiluMul ? count4 / 2 : count4;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < out4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if constexpr (E == Epilogue::kFloat) {
      static_cast<float4*>(out)[i] = SumSplits(partial, splits, count4, i);
    } else {
      int64_t g4 = i;  // the float4 of the gate (or only) sums
      if constexpr (E == Epilogue::kSiluMul) {
        const int64_t half4 = n / 8, row = i / half4;
        g4 = row * 2 * half4 + i % half4;
      }
      const float4 s = SumSplits(partial, splits, count4, g4);
      float4 u = s;
      if constexpr (E == Epilogue::kSiluMul) u = SumSplits(partial, splits, count4, g4 + n / 8);
      T* o = static_cast<T*>(out) + 4 * i;
      o[0] = Finish<T, E>(s.x, u.x, residual, 4 * i);
      o[1] = Finish<T, E>(s.y, u.y, residual, 4 * i + 1);
      o[2] = Finish<T, E>(s.z, u.z, residual, 4 * i + 2);
      o[3] = Finish<T, E>(s.w, u.w, residual, 4 * i + 3);
    }
  }
}

// ---- One row of x: a SIMT GEMV over the same blocks (a single sequence's decode step) --------
// The mma kernel multiplies 8 rows of x a tile whatever m is, so at m = 1 it spends the tensor
// cores' work and its shared-memory staging on one useful row (gate_up 40 us on an H200 against 24
// for the generated GEMV of schedules/cuda/quantized_gemv.py). Here a thread block takes one tile
// of 4 weight rows (with SiLU x up, the gate tile and its up tile) and its 2 warps split k: lane l
// of warp w takes blocks w * 32 + l, + 64, ... , so a row of 4096 columns is two blocks a lane,
// both loaded before either is summed (the loop unrolled by 2). Two warps rather than four: o's
// and down's 1,024 tiles fit in one wave, and on an H100 every 8B Q4_1 matrix ran 6-11% faster
// (qkv 7.7 us against 8.4, gate|up with SiLU x up 27.4 against 29.3). A nibble
// block's sum is 16 d (sum f x - sum x) + m sum x with f = 1 + q / 16 (one byte permute a weight,
// as Dequant), Q6_K's the same with f = 1 + q / 64 for each half, Q8_0's d sum q x; the weights are
// float32, not rounded to x's dtype as the mma's operands are (what the generated GEMV computes).
// The lanes and then the warps are added in a fixed order (the same bits every run) and the block
// finishes the result itself (Finish: no second launch).
constexpr int kGemvWarps = 2;

// The GEMV's work on one block (its loads, x's floats, a row's sum) is __host__ __device__, so a
// host build of the same code (tests/support/block_gemv_host.cu) checks every format's layout and
// arithmetic where there is no GPU; these stand in for the device intrinsics there.
#define VTOOL_HD __host__ __device__ __forceinline__
VTOOL_HD uint32_t BytePerm(uint32_t a, uint32_t b, uint32_t selector) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, selector);
#else
  const uint64_t bytes = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>((bytes >> (8 * ((selector >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
#endif
}
VTOOL_HD float BitsFloat(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}
template <typename V>
VTOOL_HD V ReadOnly(const V* p) {
#ifdef __CUDA_ARCH__
  return __ldg(p);
#else
  return *p;
#endif
}

template <typename T>
VTOOL_HD void XPair(uint32_t w, float& lo, float& hi);
template <>
VTOOL_HD void XPair<__nv_bfloat16>(uint32_t w, float& lo, float& hi) {
  lo = BitsFloat(w << 16);  // a bfloat16 is the top half of its float32
  hi = BitsFloat(w & 0xFFFF0000u);
}
template <>
VTOOL_HD void XPair<__half>(uint32_t w, float& lo, float& hi) {
  __half2 h;
  memcpy(&h, &w, sizeof h);
  const float2 f = __half22float2(h);
  lo = f.x;
  hi = f.y;
}

// x's block b as floats, and the sums of its first and second 16 (not needed by Q8_0).
template <typename T, Fmt F>
VTOOL_HD void GemvX(const T* x, int b, float (&xf)[kBlock], float& sx0, float& sx1) {
  uint4 xv[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) xv[i] = ReadOnly(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(b) * kBlock) + i);
  const uint32_t* xw = reinterpret_cast<const uint32_t*>(xv);
#pragma unroll
  for (int i = 0; i < kBlock / 2; ++i) XPair<T>(xw[i], xf[2 * i], xf[2 * i + 1]);
  sx0 = sx1 = 0.f;
  if constexpr (F != Fmt::kQ8_0) {
#pragma unroll
    for (int i = 0; i < kBlock / 2; ++i) {
      sx0 += xf[i];
      sx1 += xf[kBlock / 2 + i];
    }
  }
}

// What a lane loads of one tile's block b: the 4 rows' quants and their scales (K-quants: the
// block's 6-bit scale and min, or Q6_K's two signed scales of 16 weights and its high bits).
template <Fmt F>
struct GemvBlock {
  uint4 q[kTileRows * BlockBytes<F>() / 16];
  uint4 high[F == Fmt::kQ6_K ? kTileRows : 1];  // Q6_K: the rows' 16 bytes of high bits of the block's group of 64
  uint2 d, m;     // 4 float16 d (Q4_K, Q6_K: per 256), Q4_1's m / Q4_K's dmin
  uint2 sub;      // Q4_K: 4 scales, then 4 mins (bytes); Q6_K: 8 signed scales (half 0's 4 rows, half 1's)
};

template <Fmt F>
VTOOL_HD void LoadGemvBlock(const Parts& p, int64_t tile, int kb, int b, GemvBlock<F>& g) {
  const int64_t at = tile * kb + b;  // the tile's block b: 4 rows' quants, then the scales
  const uint4* q = reinterpret_cast<const uint4*>(p.qweight + at * kTileRows * BlockBytes<F>());
#pragma unroll
  for (int i = 0; i < kTileRows * BlockBytes<F>() / 16; ++i) g.q[i] = ReadOnly(q + i);
  if constexpr (F == Fmt::kQ4_K || F == Fmt::kQ6_K) {
    const int64_t sb = tile * (kb / 8) + b / 8;  // the block's 256
    g.d = ReadOnly(reinterpret_cast<const uint2*>(p.scale + sb * kTileRows));
    if constexpr (F == Fmt::kQ4_K) {
      g.m = ReadOnly(reinterpret_cast<const uint2*>(p.min + sb * kTileRows));
      g.sub.x = ReadOnly(reinterpret_cast<const unsigned int*>(p.sub_scale + at * kTileRows));
      g.sub.y = ReadOnly(reinterpret_cast<const unsigned int*>(p.sub_min + at * kTileRows));
    } else {  // sub_scale [n/4, k/16, 4]: halves 2b and 2b + 1, 8 bytes; qhigh [n/4, k/64, 4, 16]
      g.sub = ReadOnly(reinterpret_cast<const uint2*>(p.sub_scale + at * 2 * kTileRows));
      const uint4* h = reinterpret_cast<const uint4*>(p.qhigh + (tile * (kb / 2) + b / 2) * kTileRows * 16);
#pragma unroll
      for (int r = 0; r < kTileRows; ++r) g.high[r] = ReadOnly(h + r);
    }
  } else {
    g.d = ReadOnly(reinterpret_cast<const uint2*>(p.scale + at * kTileRows));
    if constexpr (F == Fmt::kQ4_1) g.m = ReadOnly(reinterpret_cast<const uint2*>(p.min + at * kTileRows));
  }
}

VTOOL_HD float NibbleF(uint32_t bytes, int i) {  // byte i (0x80 | q << s) as 1 + q / 2^(7-s)
  return BitsFloat(BytePerm(bytes, 0x3F000000u, 0x7044u | (i << 8)));
}

// Row `row` (0..3) of block b's sum of w . x, given x's 32 floats and their sums (whole block,
// first and second 16).
template <Fmt F>
VTOOL_HD float GemvRow(const GemvBlock<F>& g, int row, int b, const float (&xf)[kBlock], float sx,
                                         float sx0, float sx1) {
  const uint32_t* words = reinterpret_cast<const uint32_t*>(g.q) + row * (BlockBytes<F>() / 4);
  const float d = __half2float(reinterpret_cast<const __half*>(&g.d)[row]);
  if constexpr (F == Fmt::kQ8_0) {  // d sum q x, q exact through the mantissa of 2^23
    float acc = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      const uint32_t bytes = words[w] ^ 0x80808080u;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float v = BitsFloat(BytePerm(bytes, 0x4B000000u, 0x7540u | i));
        acc = fmaf(v - 8388736.f, xf[4 * w + i], acc);
      }
    }
    return d * acc;
  } else if constexpr (F == Fmt::kQ6_K) {  // q = low nibble | high 2 bits << 4 as 1 + q / 64; w = D16 (q - 32)
    const uint32_t* high = reinterpret_cast<const uint32_t*>(&g.high[row]);
    const int shift = 4 * (b % 2);  // the block's place in its group of 64
    float acc0 = 0.f, acc1 = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint32_t lo = (((words[w] & 0x0F0F0F0Fu) | (((high[w] >> shift) & 0x03030303u) << 4)) << 1) | 0x80808080u;
      const uint32_t hi = ((((words[w] >> 4) & 0x0F0F0F0Fu) | (((high[w] >> (shift + 2)) & 0x03030303u) << 4)) << 1) |
                          0x80808080u;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc0 = fmaf(NibbleF(lo, i), xf[4 * w + i], acc0);
        acc1 = fmaf(NibbleF(hi, i), xf[16 + 4 * w + i], acc1);
      }
    }
    const int8_t* sc = reinterpret_cast<const int8_t*>(&g.sub);
    const float s0 = static_cast<float>(sc[row]), s1 = static_cast<float>(sc[kTileRows + row]);
    return d * (s0 * fmaf(64.f, acc0 - sx0, -32.f * sx0) + s1 * fmaf(64.f, acc1 - sx1, -32.f * sx1));
  } else {  // a nibble as 1 + q / 16: sum q x = 16 (sum f x - sum x)
    float acc = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint32_t lo = ((words[w] & 0x0F0F0F0Fu) << 3) | 0x80808080u;  // elements 4w..4w+3
      const uint32_t hi = ((words[w] >> 1) & 0x78787878u) | 0x80808080u;  // elements 16+4w..
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc = fmaf(NibbleF(lo, i), xf[4 * w + i], acc);
        acc = fmaf(NibbleF(hi, i), xf[16 + 4 * w + i], acc);
      }
    }
    if constexpr (F == Fmt::kQ4_1) {  // d q + m
      return fmaf(16.f * d, acc - sx, __half2float(reinterpret_cast<const __half*>(&g.m)[row]) * sx);
    } else if constexpr (F == Fmt::kQ4_K) {  // d sc q - dmin mn
      const uint8_t* sub = reinterpret_cast<const uint8_t*>(&g.sub);
      const float dm = __half2float(reinterpret_cast<const __half*>(&g.m)[row]);
      return fmaf(16.f * d * static_cast<float>(sub[row]), acc - sx, -(dm * static_cast<float>(sub[4 + row])) * sx);
    } else {  // Q4_0: d (q - 8)
      return d * fmaf(16.f, acc - sx, -8.f * sx);
    }
  }
}

// An RMSNorm between two one-row GEMVs (toolchain/block_mma_norms.py), split so that no kernel
// reads a whole row it did not write: the GEMV whose residual add gives the norm's input h
// (kStats) also writes h * w (w the norm's weight; rounded to T) and, for each thread block, the
// sum of its 4 rows' h^2 in a fixed order; the GEMV that reads the norm (kPrenormed) takes h * w
// as its x, adds those block sums in a fixed order and scales its totals by
// 1 / sqrt(mean square + eps). TVM's norm rounds h * scale * w to T; here h * w is rounded and
// the scale applied to the float sums.
enum class NormRole { kNone, kStats, kPrenormed };

struct NormArgs {
  const void* weight = nullptr;  // kStats: the next norm's weight [n], T
  void* normed = nullptr;        // kStats: out * weight [n], T
  float* stats = nullptr;        // kStats: sum of out^2 over each tile's 4 rows [n / 4]
  const float* sums = nullptr;   // kPrenormed: the producer's stats [k / 4]
  float eps = 0.f;               // kPrenormed: the norm's epsilon
};

template <typename T, Fmt F, Epilogue E, NormRole N>
__global__ void __launch_bounds__(kGemvWarps * 32)
    BlockGemv(const T* __restrict__ x, Parts p, void* __restrict__ out, const T* __restrict__ residual,
              NormArgs norm, int n, int k) {
  constexpr int R = E == Epilogue::kSiluMul ? 2 : 1;  // tiles a block: SiLU x up's gate tile and its up tile
  constexpr int kSums = R * kTileRows + (N == NormRole::kPrenormed ? 1 : 0);  // + the squares' sum
  __shared__ float warp_sums[kGemvWarps][kSums];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int kb = k / kBlock;
  int64_t tile[R];
  tile[0] = blockIdx.x;
  if constexpr (R == 2) tile[1] = blockIdx.x + n / (2 * kTileRows);
  float sum[R][kTileRows];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < kTileRows; ++j) sum[r][j] = 0.f;

#pragma unroll 2
  for (int b = warp * 32 + lane; b < kb; b += kGemvWarps * 32) {
    GemvBlock<F> g[R];
#pragma unroll
    for (int r = 0; r < R; ++r) LoadGemvBlock<F>(p, tile[r], kb, b, g[r]);
    float xf[kBlock], sx0, sx1;
    GemvX<T, F>(x, b, xf, sx0, sx1);
    const float sx = sx0 + sx1;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < kTileRows; ++j) sum[r][j] += GemvRow<F>(g[r], j, b, xf, sx, sx0, sx1);
  }

#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < kTileRows; ++j) {
#pragma unroll
      for (int off = 16; off > 0; off /= 2) sum[r][j] += __shfl_xor_sync(0xFFFFFFFFu, sum[r][j], off);
    }
  float squares = 0.f;  // kPrenormed: the producer's block sums, each thread its share in order
  if constexpr (N == NormRole::kPrenormed) {
    // 16 bytes a load, unrolled so a thread's loads are in flight together (k / 16 of them a block)
    const float4* sums4 = reinterpret_cast<const float4*>(norm.sums);
#pragma unroll 4
    for (int i = threadIdx.x; i < k / (4 * kTileRows); i += kGemvWarps * 32) {
      const float4 v = ReadOnly(sums4 + i);
      squares += (v.x + v.y) + (v.z + v.w);
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) squares += __shfl_xor_sync(0xFFFFFFFFu, squares, off);
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < kTileRows; ++j) warp_sums[warp][r * kTileRows + j] = sum[r][j];
    if constexpr (N == NormRole::kPrenormed) warp_sums[warp][R * kTileRows] = squares;
  }
  __syncthreads();
  if (threadIdx.x < kTileRows) {
    const int j = threadIdx.x;
    float total[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      total[r] = warp_sums[0][r * kTileRows + j];
#pragma unroll
      for (int w = 1; w < kGemvWarps; ++w) total[r] += warp_sums[w][r * kTileRows + j];
    }
    if constexpr (N == NormRole::kPrenormed) {
      float all = warp_sums[0][R * kTileRows];
#pragma unroll
      for (int w = 1; w < kGemvWarps; ++w) all += warp_sums[w][R * kTileRows];
      const float scale = rsqrtf(all / static_cast<float>(k) + norm.eps);
#pragma unroll
      for (int r = 0; r < R; ++r) total[r] *= scale;
    }
    const int64_t row = tile[0] * kTileRows + j;  // SiLU x up: the output column (the gate row)
    if constexpr (E == Epilogue::kFloat) {
      static_cast<float*>(out)[row] = total[0];
    } else {
      const T v = Finish<T, E>(total[0], total[R - 1], residual, row);
      static_cast<T*>(out)[row] = v;
      if constexpr (N == NormRole::kStats) {  // lanes 0-3 of warp 0: the tile's rows
        const float h = static_cast<float>(v);
        static_cast<T*>(norm.normed)[row] = static_cast<T>(h * static_cast<float>(static_cast<const T*>(norm.weight)[row]));
        float sq = h * h;
        sq += __shfl_xor_sync(0xFu, sq, 1);
        sq += __shfl_xor_sync(0xFu, sq, 2);
        if (j == 0) norm.stats[tile[0]] = sq;
      }
    }
  }
}

// The norm roles Run allows: kStats with the residual add only, kPrenormed without it.
template <typename T, Fmt F>
void LaunchGemv(Epilogue e, NormRole role, const NormArgs& norm, const T* x, const Parts& p, void* out,
                const T* residual, int n, int k, cudaStream_t stream) {
  const dim3 block(kGemvWarps * 32);
  const unsigned tiles = static_cast<unsigned>(n / kTileRows);
  constexpr NormRole kNo = NormRole::kNone, kPre = NormRole::kPrenormed;
  if (role == NormRole::kStats) {
    BlockGemv<T, F, Epilogue::kCastAdd, NormRole::kStats><<<tiles, block, 0, stream>>>(x, p, out, residual, norm, n, k);
  } else if (role == kPre) {
    switch (e) {
      case Epilogue::kFloat: BlockGemv<T, F, Epilogue::kFloat, kPre><<<tiles, block, 0, stream>>>(x, p, out, residual, norm, n, k); break;
      case Epilogue::kCast: BlockGemv<T, F, Epilogue::kCast, kPre><<<tiles, block, 0, stream>>>(x, p, out, residual, norm, n, k); break;
      case Epilogue::kSiluMul: BlockGemv<T, F, Epilogue::kSiluMul, kPre><<<tiles / 2, block, 0, stream>>>(x, p, out, residual, norm, n, k); break;
      default: break;
    }
  } else {
    switch (e) {
      case Epilogue::kFloat: BlockGemv<T, F, Epilogue::kFloat, kNo><<<tiles, block, 0, stream>>>(x, p, out, residual, norm, n, k); break;
      case Epilogue::kCast: BlockGemv<T, F, Epilogue::kCast, kNo><<<tiles, block, 0, stream>>>(x, p, out, residual, norm, n, k); break;
      case Epilogue::kCastAdd: BlockGemv<T, F, Epilogue::kCastAdd, kNo><<<tiles, block, 0, stream>>>(x, p, out, residual, norm, n, k); break;
      case Epilogue::kSiluMul: BlockGemv<T, F, Epilogue::kSiluMul, kNo><<<tiles / 2, block, 0, stream>>>(x, p, out, residual, norm, n, k); break;
    }
  }
}


#ifndef VTOOL_BLOCK_MMA_KERNELS_ONLY
const char* FormatName(Fmt f) {
  switch (f) {
    case Fmt::kQ4_0: return "q4_0";
    case Fmt::kQ4_1: return "q4_1";
    case Fmt::kQ4_K: return "q4_k";
    case Fmt::kQ6_K: return "q6_k";
    default: return "q8_0";
  }
}

void* Data(const tvm::ffi::TensorView& t) { return static_cast<char*>(t.data_ptr()) + t.byte_offset(); }

void CheckPart(Fmt f, const tvm::ffi::TensorView& t, const char* part, int64_t tiles, int64_t groups,
               int64_t inner, DLDataTypeCode code, int bits) {
  bool ok = t.device().device_type == kDLCUDA && t.IsContiguous() && t.dtype().code == code &&
            t.dtype().bits == bits && t.ndim() == (inner ? 4 : 3) && t.size(0) == tiles && t.size(1) == groups &&
            t.size(2) == kTileRows && (!inner || t.size(3) == inner);
  TVM_FFI_ICHECK(ok) << "vtool_block_mma_" << FormatName(f) << ": " << part
                     << " is not a contiguous CUDA tensor [" << tiles << ", " << groups << ", " << kTileRows
                     << (inner ? ", " + std::to_string(inner) : std::string()) << "] of the block layout";
}

const char* EpilogueSuffix(Epilogue e) {
  switch (e) {
    case Epilogue::kCast: return "_cast";
    case Epilogue::kCastAdd: return "_cast_add";
    case Epilogue::kSiluMul: return "_silu_mul";
    default: return "";
  }
}

// The tensors of an RMSNorm role (NormArgs): kStats, the next norm's weight [n] (x's dtype) and
// two more outputs, normed (out's shape and dtype) and stats [n / 4] float32; kPrenormed, the
// producer's stats [k / 4] and the norm's epsilon.
struct NormViews {
  NormRole role = NormRole::kNone;
  const tvm::ffi::TensorView* weight = nullptr;
  const tvm::ffi::TensorView* normed = nullptr;
  const tvm::ffi::TensorView* stats = nullptr;
  double eps = 0.0;
};

// x[..., k] (bf16 or f16), the weight's parts, partial[splits, ..., n] float32 and out: with
// several splits (partial.shape[0]) each thread block sums its share of the blocks into partial,
// then ReduceSplits adds the splits into out; with one and no epilogue the kernel writes out
// itself. out is float32 [..., n] (kFloat), or x's dtype: [..., n] (kCast; kCastAdd, with
// `residual` of the same shape and dtype), [..., n / 2] (kSiluMul).
void Run(Fmt f, Epilogue e, tvm::ffi::TensorView x, tvm::ffi::TensorView qweight, tvm::ffi::TensorView scale,
         const tvm::ffi::TensorView* min, const tvm::ffi::TensorView* sub_scale, const tvm::ffi::TensorView* qhigh,
         const tvm::ffi::TensorView* sub_min, const tvm::ffi::TensorView* residual, tvm::ffi::TensorView partial,
         tvm::ffi::TensorView out, const NormViews& nv = NormViews{}) {
  const std::string name = std::string("vtool_block_mma_") + FormatName(f) +
                           (nv.role == NormRole::kPrenormed ? "_prenormed" : "") + EpilogueSuffix(e) +
                           (nv.role == NormRole::kStats ? "_norm_stats" : "");
  TVM_FFI_ICHECK(x.device().device_type == kDLCUDA && out.device().device_type == kDLCUDA &&
                 partial.device().device_type == kDLCUDA && (!residual || residual->device().device_type == kDLCUDA))
      << name << ": tensors must be on a CUDA device";
  TVM_FFI_ICHECK(x.IsContiguous() && out.IsContiguous() && partial.IsContiguous() &&
                 (!residual || residual->IsContiguous()))
      << name << ": x, partial and out (and residual) must be contiguous";
  TVM_FFI_ICHECK(x.ndim() >= 1 && out.ndim() == x.ndim() && partial.ndim() == x.ndim() + 1)
      << name << ": expected x[..., k], partial[splits, ..., n], out[..., n]";
  const int64_t k = x.size(-1), n = partial.size(-1), splits = partial.size(0);
  const int64_t out_n = e == Epilogue::kSiluMul ? n / 2 : n;
  int64_t m = 1;
  for (int i = 0; i + 1 < x.ndim(); ++i) {
    TVM_FFI_ICHECK(x.size(i) == out.size(i) && x.size(i) == partial.size(i + 1))
        << name << ": leading dims of x, partial and out differ";
    m *= x.size(i);
  }
  TVM_FFI_ICHECK(out.size(-1) == out_n && (e != Epilogue::kSiluMul || n % 8 == 0))
      << name << ": out has " << out.size(-1) << " columns where partial's " << n << " give " << out_n
      << (e == Epilogue::kSiluMul ? " (gate and up halves of a multiple of 4 columns each)" : "");
  TVM_FFI_ICHECK(splits >= 1 && splits <= 65535) << name << ": " << splits << " splits";
  const bool k_quant = f == Fmt::kQ4_K || f == Fmt::kQ6_K;
  TVM_FFI_ICHECK(n % kTileRows == 0 && k % (k_quant ? 256 : kBlock) == 0)
      << name << ": a [" << n << ", " << k << "] weight does not fit the block layout";
  const int64_t tiles = n / kTileRows, kb = k / kBlock;
  CheckPart(f, qweight, "qweight", tiles, kb, f == Fmt::kQ8_0 ? 32 : 16, f == Fmt::kQ8_0 ? kDLInt : kDLUInt, 8);
  const int64_t scale_groups = k_quant ? k / 256 : kb;
  CheckPart(f, scale, "scale", tiles, scale_groups, 0, kDLFloat, 16);
  if (min) CheckPart(f, *min, "min", tiles, scale_groups, 0, kDLFloat, 16);
  if (sub_scale && f == Fmt::kQ6_K) CheckPart(f, *sub_scale, "sub_scale", tiles, k / 16, 0, kDLInt, 8);
  if (sub_scale && f != Fmt::kQ6_K) CheckPart(f, *sub_scale, "sub_scale", tiles, kb, 0, kDLUInt, 8);
  if (qhigh) CheckPart(f, *qhigh, "qhigh", tiles, k / 64, 16, kDLUInt, 8);
  if (sub_min) CheckPart(f, *sub_min, "sub_min", tiles, kb, 0, kDLUInt, 8);
  TVM_FFI_ICHECK(partial.dtype().code == kDLFloat && partial.dtype().bits == 32) << name << ": partial must be float32";
  const bool bf16 = x.dtype().code == kDLBfloat && x.dtype().bits == 16;
  const bool f16 = x.dtype().code == kDLFloat && x.dtype().bits == 16;
  TVM_FFI_ICHECK(bf16 || f16) << name << ": x must be bfloat16 or float16";
  if (e == Epilogue::kFloat) {
    TVM_FFI_ICHECK(out.dtype().code == kDLFloat && out.dtype().bits == 32) << name << ": out must be float32";
  } else {
    TVM_FFI_ICHECK(out.dtype() == x.dtype()) << name << ": out must have x's dtype";
  }
  if (residual) {
    TVM_FFI_ICHECK(residual->dtype() == x.dtype() && residual->ndim() == out.ndim())
        << name << ": the residual must have x's dtype and out's shape";
    for (int i = 0; i < out.ndim(); ++i) {
      TVM_FFI_ICHECK(residual->size(i) == out.size(i)) << name << ": the residual must have out's shape";
    }
  }
  if (m == 0) return;
  TVM_FFI_ICHECK(n < (1LL << 31) && k < (1LL << 31) && m < (1LL << 31)) << name << ": too large";

  // Named members, not an aggregate's order: a part added to Parts cannot shift the others.
  Parts p{};
  p.qweight = static_cast<const uint8_t*>(Data(qweight));
  p.scale = static_cast<const __half*>(Data(scale));
  p.min = min ? static_cast<const __half*>(Data(*min)) : nullptr;
  p.sub_scale = sub_scale ? static_cast<const uint8_t*>(Data(*sub_scale)) : nullptr;
  p.qhigh = qhigh ? static_cast<const uint8_t*>(Data(*qhigh)) : nullptr;
  p.sub_min = sub_min ? static_cast<const uint8_t*>(Data(*sub_min)) : nullptr;
  // The stream TVM launches its own kernels on: ordered with them, and captured with them in a
  // CUDA graph.
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, x.device().device_id));
  const bool direct = splits == 1 && e == Epilogue::kFloat;  // the kernel's sums are the result
  float* o = static_cast<float*>(Data(direct ? out : partial));
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k), si = static_cast<int>(splits);
  const int64_t count4 = m * n / 4;  // n % 4 == 0
  const int threads = 256;
  const int64_t out4 = e == Epilogue::kSiluMul ? count4 / 2 : count4;
  const int blocks = static_cast<int>(out4 / threads + 1 < 1024 ? out4 / threads + 1 : 1024);
  const float4* sums = static_cast<const float4*>(Data(partial));
  const bool gemv = m == 1;  // one row: the GEMV writes out itself (partial unused)
  TVM_FFI_ICHECK(!gemv || reinterpret_cast<uintptr_t>(Data(x)) % 16 == 0)
      << name << ": a single row of x must start on a 16-byte boundary (its blocks are read 16 bytes at a time)";
  NormArgs norm_args;
  if (nv.role != NormRole::kNone) {
    TVM_FFI_ICHECK(gemv) << name << ": an RMSNorm is shared between one-row GEMVs, not " << m << " rows";
    auto vector_of = [&](const tvm::ffi::TensorView* t, int64_t length, bool f32) {
      return t && t->device().device_type == kDLCUDA && t->IsContiguous() && t->ndim() == 1 && t->size(0) == length &&
             (f32 ? t->dtype().code == kDLFloat && t->dtype().bits == 32 : t->dtype() == x.dtype());
    };
    if (nv.role == NormRole::kStats) {
      TVM_FFI_ICHECK(e == Epilogue::kCastAdd) << name << ": the norm's statistics come with the residual add";
      TVM_FFI_ICHECK(vector_of(nv.weight, n, false))
          << name << ": the next norm's weight must be a contiguous CUDA vector of " << n << " values in x's dtype";
      bool same = nv.normed && nv.normed->device().device_type == kDLCUDA && nv.normed->IsContiguous() &&
                  nv.normed->dtype() == x.dtype() && nv.normed->ndim() == out.ndim();
      for (int i = 0; same && i < out.ndim(); ++i) same = nv.normed->size(i) == out.size(i);
      TVM_FFI_ICHECK(same) << name << ": normed must be a contiguous CUDA tensor of out's shape in x's dtype";
      TVM_FFI_ICHECK(vector_of(nv.stats, n / kTileRows, true))
          << name << ": stats must be a contiguous float32 CUDA vector of n / 4 = " << n / kTileRows << " values";
      norm_args.weight = Data(*nv.weight);
      norm_args.normed = Data(*nv.normed);
      norm_args.stats = static_cast<float*>(Data(*nv.stats));
    } else {
      TVM_FFI_ICHECK(e != Epilogue::kCastAdd) << name << ": no residual add after a norm's matmul";
      TVM_FFI_ICHECK(vector_of(nv.stats, k / kTileRows, true) && reinterpret_cast<uintptr_t>(Data(*nv.stats)) % 16 == 0)
          << name << ": the norm's stats must be a contiguous float32 CUDA vector of k / 4 = " << k / kTileRows
          << " values on a 16-byte boundary";
      TVM_FFI_ICHECK(nv.eps >= 0.0 && nv.eps < 1.0) << name << ": the norm's epsilon " << nv.eps << " is not in [0, 1)";
      norm_args.sums = static_cast<const float*>(Data(*nv.stats));
      norm_args.eps = static_cast<float>(nv.eps);
    }
  }
#define VTOOL_LAUNCH(T)                                                                                  \
  if (gemv) {                                                                                           \
    const T* xs = static_cast<const T*>(Data(x));                                                       \
    const T* res = residual ? static_cast<const T*>(Data(*residual)) : nullptr;                         \
    switch (f) {                                                                                        \
      case Fmt::kQ4_0: LaunchGemv<T, Fmt::kQ4_0>(e, nv.role, norm_args, xs, p, Data(out), res, ni, ki, stream); break; \
      case Fmt::kQ4_1: LaunchGemv<T, Fmt::kQ4_1>(e, nv.role, norm_args, xs, p, Data(out), res, ni, ki, stream); break; \
      case Fmt::kQ4_K: LaunchGemv<T, Fmt::kQ4_K>(e, nv.role, norm_args, xs, p, Data(out), res, ni, ki, stream); break; \
      case Fmt::kQ8_0: LaunchGemv<T, Fmt::kQ8_0>(e, nv.role, norm_args, xs, p, Data(out), res, ni, ki, stream); break; \
      case Fmt::kQ6_K: LaunchGemv<T, Fmt::kQ6_K>(e, nv.role, norm_args, xs, p, Data(out), res, ni, ki, stream); break; \
    }                                                                                                   \
  } else switch (f) {                                                                                   \
    case Fmt::kQ4_0: Launch<T, Fmt::kQ4_0>(static_cast<const T*>(Data(x)), p, o, mi, ni, ki, si, stream); break; \
    case Fmt::kQ4_1: Launch<T, Fmt::kQ4_1>(static_cast<const T*>(Data(x)), p, o, mi, ni, ki, si, stream); break; \
    case Fmt::kQ4_K: Launch<T, Fmt::kQ4_K>(static_cast<const T*>(Data(x)), p, o, mi, ni, ki, si, stream); break; \
    case Fmt::kQ8_0: Launch<T, Fmt::kQ8_0>(static_cast<const T*>(Data(x)), p, o, mi, ni, ki, si, stream); break; \
    case Fmt::kQ6_K: Launch<T, Fmt::kQ6_K>(static_cast<const T*>(Data(x)), p, o, mi, ni, ki, si, stream); break; \
  }                                                                                                     \
  if (!direct && !gemv) {                                                                               \
    const T* res = residual ? static_cast<const T*>(Data(*residual)) : nullptr;                         \
    void* dst = Data(out);                                                                              \
    switch (e) {                                                                                        \
      case Epilogue::kFloat: ReduceSplits<T, Epilogue::kFloat><<<blocks, threads, 0, stream>>>(sums, dst, res, si, count4, ni); break; \
      case Epilogue::kCast: ReduceSplits<T, Epilogue::kCast><<<blocks, threads, 0, stream>>>(sums, dst, res, si, count4, ni); break; \
      case Epilogue::kCastAdd: ReduceSplits<T, Epilogue::kCastAdd><<<blocks, threads, 0, stream>>>(sums, dst, res, si, count4, ni); break; \
      case Epilogue::kSiluMul: ReduceSplits<T, Epilogue::kSiluMul><<<blocks, threads, 0, stream>>>(sums, dst, res, si, count4, ni); break; \
    }                                                                                                   \
  }
  if (bf16) {
    VTOOL_LAUNCH(__nv_bfloat16)
  } else {
    VTOOL_LAUNCH(__half)
  }
#undef VTOOL_LAUNCH
  const cudaError_t err = cudaGetLastError();
  TVM_FFI_ICHECK(err == cudaSuccess) << name << ": launch failed: " << cudaGetErrorString(err);
}

// The exported functions, one per format and epilogue: x, the format's parts (ggml_blocks.parts
// order), for *_cast_add the residual, then the outputs partial and out (Relax's
// call_dps_packed order).
template <Epilogue E>
void MmaQ4_0(tvm::ffi::TensorView x, tvm::ffi::TensorView qweight, tvm::ffi::TensorView scale,
             tvm::ffi::TensorView partial, tvm::ffi::TensorView out) {
  Run(Fmt::kQ4_0, E, x, qweight, scale, nullptr, nullptr, nullptr, nullptr, nullptr, partial, out);
}
void MmaQ4_0Add(tvm::ffi::TensorView x, tvm::ffi::TensorView qweight, tvm::ffi::TensorView scale,
                tvm::ffi::TensorView residual, tvm::ffi::TensorView partial, tvm::ffi::TensorView out) {
  Run(Fmt::kQ4_0, Epilogue::kCastAdd, x, qweight, scale, nullptr, nullptr, nullptr, nullptr, &residual, partial, out);
}

template <Epilogue E>
void MmaQ4_1(tvm::ffi::TensorView x, tvm::ffi::TensorView qweight, tvm::ffi::TensorView scale,
             tvm::ffi::TensorView min, tvm::ffi::TensorView partial, tvm::ffi::TensorView out) {
  Run(Fmt::kQ4_1, E, x, qweight, scale, &min, nullptr, nullptr, nullptr, nullptr, partial, out);
}
void MmaQ4_1Add(tvm::ffi::TensorView x, tvm::ffi::TensorView qweight, tvm::ffi::TensorView scale,
                tvm::ffi::TensorView min, tvm::ffi::TensorView residual, tvm::ffi::TensorView partial,
                tvm::ffi::TensorView out) {
  Run(Fmt::kQ4_1, Epilogue::kCastAdd, x, qweight, scale, &min, nullptr, nullptr, nullptr, &residual, partial, out);
}

template <Epilogue E>
void MmaQ8_0(tvm::ffi::TensorView x, tvm::ffi::TensorView qweight, tvm::ffi::TensorView scale,
             tvm::ffi::TensorView partial, tvm::ffi::TensorView out) {
  Run(Fmt::kQ8_0, E, x, qweight, scale, nullptr, nullptr, nullptr, nullptr, nullptr, partial, out);
}
void MmaQ8_0Add(tvm::ffi::TensorView x, tvm::ffi::TensorView qweight, tvm::ffi::TensorView scale,
                tvm::ffi::TensorView residual, tvm::ffi::TensorView partial, tvm::ffi::TensorView out) {
  Run(Fmt::kQ8_0, Epilogue::kCastAdd, x, qweight, scale, nullptr, nullptr, nullptr, nullptr, &residual, partial, out);
}

template <Epilogue E>
void MmaQ4_K(tvm::ffi::TensorView x, tvm::ffi::TensorView qweight, tvm::ffi::TensorView scale,
             tvm::ffi::TensorView min, tvm::ffi::TensorView sub_scale, tvm::ffi::TensorView sub_min,
             tvm::ffi::TensorView partial, tvm::ffi::TensorView out) {
  Run(Fmt::kQ4_K, E, x, qweight, scale, &min, &sub_scale, nullptr, &sub_min, nullptr, partial, out);
}
void MmaQ4_KAdd(tvm::ffi::TensorView x, tvm::ffi::TensorView qweight, tvm::ffi::TensorView scale,
                tvm::ffi::TensorView min, tvm::ffi::TensorView sub_scale, tvm::ffi::TensorView sub_min,
                tvm::ffi::TensorView residual, tvm::ffi::TensorView partial, tvm::ffi::TensorView out) {
  Run(Fmt::kQ4_K, Epilogue::kCastAdd, x, qweight, scale, &min, &sub_scale, nullptr, &sub_min, &residual, partial, out);
}

template <Epilogue E>
void MmaQ6_K(tvm::ffi::TensorView x, tvm::ffi::TensorView qweight, tvm::ffi::TensorView qhigh,
             tvm::ffi::TensorView scale, tvm::ffi::TensorView sub_scale, tvm::ffi::TensorView partial,
             tvm::ffi::TensorView out) {
  Run(Fmt::kQ6_K, E, x, qweight, scale, nullptr, &sub_scale, &qhigh, nullptr, nullptr, partial, out);
}
void MmaQ6_KAdd(tvm::ffi::TensorView x, tvm::ffi::TensorView qweight, tvm::ffi::TensorView qhigh,
                tvm::ffi::TensorView scale, tvm::ffi::TensorView sub_scale, tvm::ffi::TensorView residual,
                tvm::ffi::TensorView partial, tvm::ffi::TensorView out) {
  Run(Fmt::kQ6_K, Epilogue::kCastAdd, x, qweight, scale, nullptr, &sub_scale, &qhigh, nullptr, &residual, partial, out);
}

// An RMSNorm between two one-row GEMVs (NormRole): the residual add's function with the next
// norm's weight and two more outputs (`*_cast_add_norm_stats`: x, parts, residual, weight, then
// partial, out, normed, stats), and the functions reading the norm (`*_prenormed[_cast|_silu_mul]`:
// normed as x, stats, epsilon, parts, then partial and out).
using TV = tvm::ffi::TensorView;
NormViews Stats(const TV& weight, const TV& normed, const TV& stats) {
  NormViews v;
  v.role = NormRole::kStats;
  v.weight = &weight;
  v.normed = &normed;
  v.stats = &stats;
  return v;
}
NormViews Prenormed(const TV& stats, double eps) {
  NormViews v;
  v.role = NormRole::kPrenormed;
  v.stats = &stats;
  v.eps = eps;
  return v;
}

void StatsQ4_0(TV x, TV qweight, TV scale, TV residual, TV weight, TV partial, TV out, TV normed, TV stats) {
  Run(Fmt::kQ4_0, Epilogue::kCastAdd, x, qweight, scale, nullptr, nullptr, nullptr, nullptr, &residual, partial, out,
      Stats(weight, normed, stats));
}
void StatsQ4_1(TV x, TV qweight, TV scale, TV min, TV residual, TV weight, TV partial, TV out, TV normed, TV stats) {
  Run(Fmt::kQ4_1, Epilogue::kCastAdd, x, qweight, scale, &min, nullptr, nullptr, nullptr, &residual, partial, out,
      Stats(weight, normed, stats));
}
void StatsQ8_0(TV x, TV qweight, TV scale, TV residual, TV weight, TV partial, TV out, TV normed, TV stats) {
  Run(Fmt::kQ8_0, Epilogue::kCastAdd, x, qweight, scale, nullptr, nullptr, nullptr, nullptr, &residual, partial, out,
      Stats(weight, normed, stats));
}
void StatsQ4_K(TV x, TV qweight, TV scale, TV min, TV sub_scale, TV sub_min, TV residual, TV weight, TV partial,
               TV out, TV normed, TV stats) {
  Run(Fmt::kQ4_K, Epilogue::kCastAdd, x, qweight, scale, &min, &sub_scale, nullptr, &sub_min, &residual, partial, out,
      Stats(weight, normed, stats));
}
void StatsQ6_K(TV x, TV qweight, TV qhigh, TV scale, TV sub_scale, TV residual, TV weight, TV partial, TV out,
               TV normed, TV stats) {
  Run(Fmt::kQ6_K, Epilogue::kCastAdd, x, qweight, scale, nullptr, &sub_scale, &qhigh, nullptr, &residual, partial, out,
      Stats(weight, normed, stats));
}

template <Epilogue E>
void PrenormedQ4_0(TV x, TV stats, double eps, TV qweight, TV scale, TV partial, TV out) {
  Run(Fmt::kQ4_0, E, x, qweight, scale, nullptr, nullptr, nullptr, nullptr, nullptr, partial, out, Prenormed(stats, eps));
}
template <Epilogue E>
void PrenormedQ4_1(TV x, TV stats, double eps, TV qweight, TV scale, TV min, TV partial, TV out) {
  Run(Fmt::kQ4_1, E, x, qweight, scale, &min, nullptr, nullptr, nullptr, nullptr, partial, out, Prenormed(stats, eps));
}
template <Epilogue E>
void PrenormedQ8_0(TV x, TV stats, double eps, TV qweight, TV scale, TV partial, TV out) {
  Run(Fmt::kQ8_0, E, x, qweight, scale, nullptr, nullptr, nullptr, nullptr, nullptr, partial, out, Prenormed(stats, eps));
}
template <Epilogue E>
void PrenormedQ4_K(TV x, TV stats, double eps, TV qweight, TV scale, TV min, TV sub_scale, TV sub_min, TV partial,
                   TV out) {
  Run(Fmt::kQ4_K, E, x, qweight, scale, &min, &sub_scale, nullptr, &sub_min, nullptr, partial, out,
      Prenormed(stats, eps));
}
template <Epilogue E>
void PrenormedQ6_K(TV x, TV stats, double eps, TV qweight, TV qhigh, TV scale, TV sub_scale, TV partial, TV out) {
  Run(Fmt::kQ6_K, E, x, qweight, scale, nullptr, &sub_scale, &qhigh, nullptr, nullptr, partial, out,
      Prenormed(stats, eps));
}

}  // namespace

// Each format's four functions: the float32 result, then each epilogue's.
#define VTOOL_EXPORT_FORMAT(fmt, Fn)                                                       \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(vtool_block_mma_##fmt, Fn<Epilogue::kFloat>);              \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(vtool_block_mma_##fmt##_cast, Fn<Epilogue::kCast>);        \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(vtool_block_mma_##fmt##_cast_add, Fn##Add);                \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(vtool_block_mma_##fmt##_silu_mul, Fn<Epilogue::kSiluMul>);
VTOOL_EXPORT_FORMAT(q4_0, MmaQ4_0)
VTOOL_EXPORT_FORMAT(q4_1, MmaQ4_1)
VTOOL_EXPORT_FORMAT(q8_0, MmaQ8_0)
VTOOL_EXPORT_FORMAT(q4_k, MmaQ4_K)
VTOOL_EXPORT_FORMAT(q6_k, MmaQ6_K)
#undef VTOOL_EXPORT_FORMAT
// ... and its RMSNorm pair: the residual add that writes the norm's statistics, and the three
// functions reading the norm (q|k|v's cast, gate|up's SiLU x up, the lm_head's float result).
#define VTOOL_EXPORT_NORM(fmt, StatsFn, ReadFn)                                                \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(vtool_block_mma_##fmt##_cast_add_norm_stats, StatsFn);         \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(vtool_block_mma_##fmt##_prenormed, ReadFn<Epilogue::kFloat>);  \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(vtool_block_mma_##fmt##_prenormed_cast, ReadFn<Epilogue::kCast>); \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(vtool_block_mma_##fmt##_prenormed_silu_mul, ReadFn<Epilogue::kSiluMul>);
VTOOL_EXPORT_NORM(q4_0, StatsQ4_0, PrenormedQ4_0)
VTOOL_EXPORT_NORM(q4_1, StatsQ4_1, PrenormedQ4_1)
VTOOL_EXPORT_NORM(q8_0, StatsQ8_0, PrenormedQ8_0)
VTOOL_EXPORT_NORM(q4_k, StatsQ4_K, PrenormedQ4_K)
VTOOL_EXPORT_NORM(q6_k, StatsQ6_K, PrenormedQ6_K)
#undef VTOOL_EXPORT_NORM
#else
}  // namespace
#endif  // VTOOL_BLOCK_MMA_KERNELS_ONLY
