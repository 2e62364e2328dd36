// A host build of the one-row GEMV's per-block code of toolchain/native/block_mma.cu (its loads of a
// tile's block, x's floats, a row's sum: the same functions the kernel calls), for
// tests/test_gpu_block_mma.py to hold every format's layout and arithmetic against numpy where there
// is no GPU. Only the thread structure (lanes and warps over k, their sum, the epilogues) is the
// kernel's alone; here each row's blocks are added in order.
#define VTOOL_BLOCK_MMA_KERNELS_ONLY
#include "../../toolchain/native/block_mma.cu"

namespace {

template <typename T, Fmt F>
void HostRows(const T* x, const Parts& p, int n, int k, float* out) {
  const int kb = k / kBlock;
  for (int64_t tile = 0; tile < n / kTileRows; ++tile) {
    float sum[kTileRows] = {};
    for (int b = 0; b < kb; ++b) {
      GemvBlock<F> g;
      LoadGemvBlock<F>(p, tile, kb, b, g);
      float xf[kBlock], sx0, sx1;
      GemvX<T, F>(x, b, xf, sx0, sx1);
      for (int j = 0; j < kTileRows; ++j) sum[j] += GemvRow<F>(g, j, b, xf, sx0 + sx1, sx0, sx1);
    }
    for (int j = 0; j < kTileRows; ++j) out[tile * kTileRows + j] = sum[j];
  }
}

template <typename T>
int HostRowsOf(int fmt, const T* x, const Parts& p, int n, int k, float* out) {
  switch (static_cast<Fmt>(fmt)) {
    case Fmt::kQ4_0: HostRows<T, Fmt::kQ4_0>(x, p, n, k, out); return 0;
    case Fmt::kQ4_1: HostRows<T, Fmt::kQ4_1>(x, p, n, k, out); return 0;
    case Fmt::kQ4_K: HostRows<T, Fmt::kQ4_K>(x, p, n, k, out); return 0;
    case Fmt::kQ8_0: HostRows<T, Fmt::kQ8_0>(x, p, n, k, out); return 0;
    case Fmt::kQ6_K: HostRows<T, Fmt::kQ6_K>(x, p, n, k, out); return 0;
  }
  return 1;
}

}  // namespace

// out[n] = x[k] . dequant(W)^T for one row of x (bf16 when x_bf16, else f16); fmt: block_mma.cu's
// Fmt order (Q4_0, Q4_1, Q4_K, Q8_0, Q6_K); parts a format lacks are null. Returns 0, or 1 for an
// unknown format.
extern "C" int vtool_block_gemv_host(int fmt, int x_bf16, const void* x, const uint8_t* qweight, const void* scale,
                                     const void* min, const uint8_t* sub_scale, const uint8_t* qhigh,
                                     const uint8_t* sub_min, int n, int k, float* out) {
  Parts p{};
  p.qweight = qweight;
  p.scale = static_cast<const __half*>(scale);
  p.min = static_cast<const __half*>(min);
  p.sub_scale = sub_scale;
  p.qhigh = qhigh;
  p.sub_min = sub_min;
  return x_bf16 ? HostRowsOf(fmt, static_cast<const __nv_bfloat16*>(x), p, n, k, out)
                : HostRowsOf(fmt, static_cast<const __half*>(x), p, n, k, out);
}
