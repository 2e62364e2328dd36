// Rows of float32 sorted in descending order, for the GPU sampler's top-p / top-k
// (schedules/cuda/sampler.py): out[i, :] = sort(x[i, :], descending).
//
// Why: TVM's CUDA sort (topi.gpu.sort, what relax.op.sort lowers to) took 1.5 ms of GPU time for
// 64 rows of 128,256 logits on an H200, most of a top-p draw. Here every row goes through one
// device-wide CUB radix sort (all SMs busy whatever the batch): one row as float keys; several
// rows as 64-bit keys, the row index above the value's order-preserving 32 bits, so the sorted
// keys come out row by row and each row in order. (CUB's segmented sort, one thread block a long
// segment, took 0.54 ms for 8 rows.) Only values are sorted; the sampler needs no permutation.
//
// Scratch memory (the 64-bit keys, twice, and CUB's own) comes from the stream-ordered allocator
// (cudaMallocAsync / cudaFreeAsync on the stream TVM launches on): ordered with the kernels around
// it, and no call synchronizes.
#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <cub/device/device_radix_sort.cuh>

#include <cstdint>

namespace {

// float bits -> uint32 whose ascending order is the floats' descending order.
__device__ __forceinline__ uint32_t DescendingKey(float v) {
  const uint32_t bits = __float_as_uint(v);
  const uint32_t ascending = bits ^ ((bits & 0x80000000u) ? 0xFFFFFFFFu : 0x80000000u);
  return ~ascending;
}

__device__ __forceinline__ float FromDescendingKey(uint32_t key) {
  const uint32_t ascending = ~key;
  return __uint_as_float(ascending ^ ((ascending & 0x80000000u) ? 0x80000000u : 0xFFFFFFFFu));
}

__global__ void PackRows(const float* x, uint64_t* keys, int64_t n, int64_t cols) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    keys[i] = (static_cast<uint64_t>(i / cols) << 32) | DescendingKey(x[i]);
  }
}

__global__ void UnpackRows(const uint64_t* keys, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    out[i] = FromDescendingKey(static_cast<uint32_t>(keys[i]));
  }
}

void Check(cudaError_t err, const char* what) {
  TVM_FFI_ICHECK(err == cudaSuccess) << "vtool_sort_rows_desc: " << what << " failed: " << cudaGetErrorString(err);
}

void SortRowsDesc(tvm::ffi::TensorView x, tvm::ffi::TensorView out) {
  TVM_FFI_ICHECK(x.ndim() == 2 && out.ndim() == 2) << "vtool_sort_rows_desc: x and out must be 2-D";
  TVM_FFI_ICHECK(x.dtype().code == kDLFloat && x.dtype().bits == 32 && out.dtype().code == kDLFloat &&
                 out.dtype().bits == 32)
      << "vtool_sort_rows_desc: x and out must be float32";
  const int64_t rows = x.size(0), cols = x.size(1);
  TVM_FFI_ICHECK(out.size(0) == rows && out.size(1) == cols) << "vtool_sort_rows_desc: out's shape differs from x's";
  TVM_FFI_ICHECK(rows * cols < (1LL << 31) && rows < (1LL << 31)) << "vtool_sort_rows_desc: more than 2^31 values";
  if (rows == 0 || cols == 0) return;
  const float* in = reinterpret_cast<const float*>(static_cast<const char*>(x.data_ptr()) + x.byte_offset());
  float* res = reinterpret_cast<float*>(static_cast<char*>(out.data_ptr()) + out.byte_offset());
  const int n = static_cast<int>(rows * cols);
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, x.device().device_id));

  if (rows == 1) {
    size_t scratch_bytes = 0;
    Check(cub::DeviceRadixSort::SortKeysDescending(nullptr, scratch_bytes, in, res, n, 0, 32, stream), "sizing");
    void* scratch = nullptr;
    Check(cudaMallocAsync(&scratch, scratch_bytes, stream), "cudaMallocAsync");
    const cudaError_t err = cub::DeviceRadixSort::SortKeysDescending(scratch, scratch_bytes, in, res, n, 0, 32, stream);
    const cudaError_t freed = cudaFreeAsync(scratch, stream);
    Check(err, "the sort");
    Check(freed, "cudaFreeAsync");
    Check(cudaGetLastError(), "a launch");
    return;
  }
  int row_bits = 0;
  while ((1LL << row_bits) < rows) ++row_bits;
  const size_t key_bytes = (static_cast<size_t>(n) * sizeof(uint64_t) + 255) / 256 * 256;
  size_t scratch_bytes = 0;
  cub::DoubleBuffer<uint64_t> sizing(nullptr, nullptr);
  Check(cub::DeviceRadixSort::SortKeys(nullptr, scratch_bytes, sizing, n, 0, 32 + row_bits, stream), "sizing");
  char* scratch = nullptr;
  Check(cudaMallocAsync(reinterpret_cast<void**>(&scratch), 2 * key_bytes + scratch_bytes, stream), "cudaMallocAsync");
  uint64_t* keys = reinterpret_cast<uint64_t*>(scratch);
  cub::DoubleBuffer<uint64_t> buffers(keys, reinterpret_cast<uint64_t*>(scratch + key_bytes));
  const int threads = 256, blocks = static_cast<int>((n + threads - 1) / threads < 4096 ? (n + threads - 1) / threads : 4096);
  PackRows<<<blocks, threads, 0, stream>>>(in, keys, n, cols);
  const cudaError_t err =
      cub::DeviceRadixSort::SortKeys(scratch + 2 * key_bytes, scratch_bytes, buffers, n, 0, 32 + row_bits, stream);
  if (err == cudaSuccess) UnpackRows<<<blocks, threads, 0, stream>>>(buffers.Current(), res, n);
  const cudaError_t freed = cudaFreeAsync(scratch, stream);
  Check(err, "the sort");
  Check(freed, "cudaFreeAsync");
  Check(cudaGetLastError(), "a launch");
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(vtool_sort_rows_desc, SortRowsDesc);
