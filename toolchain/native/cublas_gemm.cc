// y = x @ w^T on cuBLAS, for the prefill and batched-decode matmuls of CUDA builds.
//
// Linked into the model library itself (toolchain/cublas.py compiles this file at build
// time), and exported as the FFI symbol the Relax VM finds among the library's own
// functions: `vtool_cublas_gemm_nt`. cuBLAS is opened with dlopen on the first call, so
// building needs no CUDA headers or libraries and a library built with it still loads
// (and its batch-1 decode, which stays on vtool's own GEMV kernels, still runs) on a
// machine whose cuBLAS is missing until a prefill needs it.
//
// The cuBLAS declarations below are the stable C ABI of cublas_v2.h (CUDA 11-13); the
// enum values are those of library_types.h and cublas_api.h.
#include <dlfcn.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>

namespace {

using cublasHandle = void*;
using cudaStream = void*;
// cudaDataType_t / cublasComputeType_t / cublasOperation_t / cublasGemmAlgo_t values
constexpr int kCudaR32F = 0, kCudaR16F = 2, kCudaR16BF = 14;
constexpr int kComputeF32 = 68;
constexpr int kOpN = 0, kOpT = 1;
constexpr int kGemmDefault = -1;

using CreateFn = int (*)(cublasHandle*);
using SetStreamFn = int (*)(cublasHandle, cudaStream);
using GemmExFn = int (*)(cublasHandle, int, int, int, int, int, const void*, const void*, int, int,
                         const void*, int, int, const void*, void*, int, int, int, int);

struct Cublas {
  CreateFn create = nullptr;
  SetStreamFn set_stream = nullptr;
  GemmExFn gemm_ex = nullptr;
  std::unordered_map<int, cublasHandle> handles;  // one per CUDA device
  std::mutex mu;
};

void* OpenCublas() {
  // The runtime (vtool.runtime.cuda) preloads the library it found, so the soname lookup
  // below returns that copy; VTOOL_CUBLAS_LIBRARY names one explicitly.
  const char* named = std::getenv("VTOOL_CUBLAS_LIBRARY");
  const char* candidates[] = {named, "libcublas.so.13", "libcublas.so.12", "libcublas.so"};
  for (const char* name : candidates) {
    if (name == nullptr || *name == '\0') continue;
    if (void* lib = dlopen(name, RTLD_NOW | RTLD_GLOBAL)) return lib;
  }
  return nullptr;
}

Cublas& Library() {
  static Cublas* lib = [] {
    auto* c = new Cublas();
    void* handle = OpenCublas();
    if (handle == nullptr) {
      TVM_FFI_THROW(RuntimeError)
          << "this library runs its prefill and batched matmuls on cuBLAS, and no cuBLAS was "
             "found (tried VTOOL_CUBLAS_LIBRARY, libcublas.so.13, libcublas.so.12): install it "
             "with `pip install nvidia-cublas` or rebuild with `vtool build --gemm tir`";
    }
    c->create = reinterpret_cast<CreateFn>(dlsym(handle, "cublasCreate_v2"));
    c->set_stream = reinterpret_cast<SetStreamFn>(dlsym(handle, "cublasSetStream_v2"));
    c->gemm_ex = reinterpret_cast<GemmExFn>(dlsym(handle, "cublasGemmEx"));
    if (!c->create || !c->set_stream || !c->gemm_ex) {
      TVM_FFI_THROW(RuntimeError) << "the cuBLAS library found lacks cublasCreate_v2, "
                                     "cublasSetStream_v2 or cublasGemmEx";
    }
    return c;
  }();
  return *lib;
}

int CudaType(DLDataType t) {
  if (t.code == kDLBfloat && t.bits == 16) return kCudaR16BF;
  if (t.code == kDLFloat && t.bits == 16) return kCudaR16F;
  if (t.code == kDLFloat && t.bits == 32) return kCudaR32F;
  TVM_FFI_THROW(TypeError) << "vtool_cublas_gemm_nt: unsupported dtype code " << int(t.code)
                           << " bits " << int(t.bits);
  return -1;
}

void* DataPtr(const tvm::ffi::TensorView& t) {
  return static_cast<char*>(t.data_ptr()) + t.byte_offset();
}

// The shape of out[..., n] = x[..., k] @ w[n, k]^T, after the checks both entry points share (CUDA,
// contiguous, shapes agreeing); `name` prefixes every refusal.
struct GemmShape {
  int64_t m, n, k;
};

GemmShape CheckNT(const char* name, const tvm::ffi::TensorView& x, const tvm::ffi::TensorView& w,
                  const tvm::ffi::TensorView& out) {
  TVM_FFI_ICHECK(x.device().device_type == kDLCUDA && w.device().device_type == kDLCUDA &&
                 out.device().device_type == kDLCUDA)
      << name << ": tensors must be on a CUDA device";
  TVM_FFI_ICHECK(w.ndim() == 2 && x.ndim() >= 1 && out.ndim() == x.ndim())
      << name << ": expected x[..., k], w[n, k], out[..., n]";
  TVM_FFI_ICHECK(x.IsContiguous() && w.IsContiguous() && out.IsContiguous()) << name << ": tensors must be contiguous";
  const int64_t n = w.size(0), k = w.size(1);
  TVM_FFI_ICHECK(x.size(-1) == k && out.size(-1) == n)
      << name << ": shapes disagree (x last dim " << x.size(-1) << ", w " << n << "x" << k << ", out last dim "
      << out.size(-1) << ")";
  int64_t m = 1;
  for (int i = 0; i + 1 < x.ndim(); ++i) {
    TVM_FFI_ICHECK(x.size(i) == out.size(i)) << name << ": leading dims differ";
    m *= x.size(i);
  }
  return {m, n, k};
}

// out[..., n] = x[..., k] @ w[n, k]^T, accumulated in float32 whatever the storage dtype.
void GemmNT(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView out) {
  const auto [m, n, k] = CheckNT("vtool_cublas_gemm_nt", x, w, out);
  if (m == 0) return;
  const int ab_type = CudaType(x.dtype());
  TVM_FFI_ICHECK(CudaType(w.dtype()) == ab_type) << "vtool_cublas_gemm_nt: x and w dtypes differ";
  const int c_type = CudaType(out.dtype());
  const int device_id = x.device().device_id;

  Cublas& lib = Library();
  cublasHandle handle;
  {
    std::lock_guard<std::mutex> lock(lib.mu);
    auto it = lib.handles.find(device_id);
    if (it == lib.handles.end()) {
      cublasHandle created = nullptr;
      int status = lib.create(&created);
      TVM_FFI_ICHECK(status == 0) << "cublasCreate failed with status " << status;
      it = lib.handles.emplace(device_id, created).first;
    }
    handle = it->second;
  }
  // The stream TVM launches its own kernels on, so ordering needs no extra sync.
  cudaStream stream = TVMFFIEnvGetStream(kDLCUDA, device_id);
  int status = lib.set_stream(handle, stream);
  TVM_FFI_ICHECK(status == 0) << "cublasSetStream failed with status " << status;

  // Row-major out[m, n] is column-major out^T[n, m] = w[n, k] (col-major k x n, transposed)
  // times x^T (col-major k x m).
  const float alpha = 1.0f, beta = 0.0f;
  status = lib.gemm_ex(handle, kOpT, kOpN, static_cast<int>(n), static_cast<int>(m),
                       static_cast<int>(k), &alpha, DataPtr(w), ab_type, static_cast<int>(k),
                       DataPtr(x), ab_type, static_cast<int>(k), &beta, DataPtr(out), c_type,
                       static_cast<int>(n), kComputeF32, kGemmDefault);
  TVM_FFI_ICHECK(status == 0) << "cublasGemmEx failed with status " << status << " (m=" << m
                              << ", n=" << n << ", k=" << k << ")";
}

// ---- FP8 (e4m3 x e4m3) on cuBLASLt -----------------------------------------------------------
// cublasGemmEx has no FP8 types; cuBLASLt's matmul does (sm_89 and newer), in the "TN" layout it
// requires, which row-major x[m, k] @ w[n, k]^T is. The scales stay outside (the model multiplies
// the float32 result by the activation and weight scales), so A/B scale pointers are left unset:
// cuBLASLt takes them as 1. The declarations are cublasLt.h's C ABI (CUDA 12-13).

using LtHandle = void*;
using LtDesc = void*;
using LtLayout = void*;
using LtPref = void*;
struct LtAlgo {
  uint64_t data[8];
};
struct LtHeuristic {
  LtAlgo algo;
  size_t workspace_size;
  int state;
  float waves;
  int reserved[4];
};
constexpr int kCudaR8FE4M3 = 28;
constexpr int kLtDescTransA = 3, kLtDescTransB = 4;

struct CublasLt {
  int (*create)(LtHandle*) = nullptr;
  int (*desc_create)(LtDesc*, int, int) = nullptr;
  int (*desc_set)(LtDesc, int, const void*, size_t) = nullptr;
  int (*layout_create)(LtLayout*, int, uint64_t, uint64_t, int64_t) = nullptr;
  int (*pref_create)(LtPref*) = nullptr;
  int (*heuristic)(LtHandle, LtDesc, LtLayout, LtLayout, LtLayout, LtLayout, LtPref, int, LtHeuristic*,
                   int*) = nullptr;
  int (*matmul)(LtHandle, LtDesc, const void*, const void*, LtLayout, const void*, LtLayout, const void*,
                const void*, LtLayout, void*, LtLayout, const LtAlgo*, void*, size_t, cudaStream) = nullptr;
  std::unordered_map<int, LtHandle> handles;  // one per CUDA device
  // (device, m, n, k, out type) -> the descriptors and the algorithm the heuristic chose for them
  struct Plan {
    LtDesc desc;
    LtLayout a, b, d;
    LtAlgo algo;
  };
  std::unordered_map<std::string, Plan> plans;
  std::mutex mu;
};

template <typename Fn>
void Bind(void* lib, const char* name, Fn* fn) {
  *fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (*fn == nullptr) {
    TVM_FFI_THROW(RuntimeError) << "the cuBLASLt library found lacks " << name;
  }
}

CublasLt& LtLibrary() {
  static CublasLt* lib = [] {
    auto* c = new CublasLt();
    const char* named = std::getenv("VTOOL_CUBLASLT_LIBRARY");
    const char* candidates[] = {named, "libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"};
    void* handle = nullptr;
    for (const char* name : candidates) {
      if (name == nullptr || *name == '\0') continue;
      if ((handle = dlopen(name, RTLD_NOW | RTLD_GLOBAL)) != nullptr) break;
    }
    if (handle == nullptr) {
      TVM_FFI_THROW(RuntimeError)
          << "this library runs its FP8 prefill and batched matmuls on cuBLASLt, and none was found "
             "(tried VTOOL_CUBLASLT_LIBRARY, libcublasLt.so.13, libcublasLt.so.12): install it with "
             "`pip install nvidia-cublas`";
    }
    Bind(handle, "cublasLtCreate", &c->create);
    Bind(handle, "cublasLtMatmulDescCreate", &c->desc_create);
    Bind(handle, "cublasLtMatmulDescSetAttribute", &c->desc_set);
    Bind(handle, "cublasLtMatrixLayoutCreate", &c->layout_create);
    Bind(handle, "cublasLtMatmulPreferenceCreate", &c->pref_create);
    Bind(handle, "cublasLtMatmulAlgoGetHeuristic", &c->heuristic);
    Bind(handle, "cublasLtMatmul", &c->matmul);
    return c;
  }();
  return *lib;
}

void CheckLt(int status, const char* what, int64_t m, int64_t n, int64_t k) {
  TVM_FFI_ICHECK(status == 0) << what << " failed with status " << status << " (FP8 GEMM m=" << m
                              << ", n=" << n << ", k=" << k << ")";
}

// out[..., n] = x[..., k] @ w[n, k]^T, x and w float8_e4m3fn, summed in float32; out float32/bf16/f16.
void Fp8GemmNT(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView out) {
  const auto [m, n, k] = CheckNT("vtool_cublaslt_fp8_gemm_nt", x, w, out);
  const DLDataType xt = x.dtype(), wt = w.dtype();
  TVM_FFI_ICHECK(xt.code == kDLFloat8_e4m3fn && xt.bits == 8 && wt.code == kDLFloat8_e4m3fn && wt.bits == 8)
      << "vtool_cublaslt_fp8_gemm_nt: x and w must be float8_e4m3fn";
  TVM_FFI_ICHECK(k % 16 == 0) << "vtool_cublaslt_fp8_gemm_nt: k=" << k << " is not a multiple of 16";
  if (m == 0) return;
  const int d_type = CudaType(out.dtype());
  const int device_id = x.device().device_id;

  CublasLt& lib = LtLibrary();
  LtHandle handle;
  CublasLt::Plan plan;
  {
    std::lock_guard<std::mutex> lock(lib.mu);
    auto it = lib.handles.find(device_id);
    if (it == lib.handles.end()) {
      LtHandle created = nullptr;
      CheckLt(lib.create(&created), "cublasLtCreate", m, n, k);
      it = lib.handles.emplace(device_id, created).first;
    }
    handle = it->second;
    const std::string key = std::to_string(device_id) + ":" + std::to_string(m) + ":" + std::to_string(n) + ":" +
                            std::to_string(k) + ":" + std::to_string(d_type);
    auto found = lib.plans.find(key);
    if (found == lib.plans.end()) {
      if (lib.plans.size() >= 4096) lib.plans.clear();  // prompt lengths vary: keep the cache bounded (leaks a few descriptors)
      CublasLt::Plan p{};
      CheckLt(lib.desc_create(&p.desc, kComputeF32, kCudaR32F), "cublasLtMatmulDescCreate", m, n, k);
      const int op_t = kOpT, op_n = kOpN;
      CheckLt(lib.desc_set(p.desc, kLtDescTransA, &op_t, sizeof(op_t)), "setting TRANSA", m, n, k);
      CheckLt(lib.desc_set(p.desc, kLtDescTransB, &op_n, sizeof(op_n)), "setting TRANSB", m, n, k);
      // Column-major: A = w as k x n (transposed by the op), B = x as k x m, D = out^T as n x m.
      CheckLt(lib.layout_create(&p.a, kCudaR8FE4M3, k, n, k), "cublasLtMatrixLayoutCreate(A)", m, n, k);
      CheckLt(lib.layout_create(&p.b, kCudaR8FE4M3, k, m, k), "cublasLtMatrixLayoutCreate(B)", m, n, k);
      CheckLt(lib.layout_create(&p.d, d_type, n, m, n), "cublasLtMatrixLayoutCreate(D)", m, n, k);
      LtPref pref = nullptr;
      CheckLt(lib.pref_create(&pref), "cublasLtMatmulPreferenceCreate", m, n, k);
      // No workspace: the call may be captured in a CUDA graph, where nothing may be allocated.
      LtHeuristic result{};
      int found_algos = 0;
      CheckLt(lib.heuristic(handle, p.desc, p.a, p.b, p.d, p.d, pref, 1, &result, &found_algos),
              "cublasLtMatmulAlgoGetHeuristic", m, n, k);
      TVM_FFI_ICHECK(found_algos > 0) << "cuBLASLt has no FP8 algorithm for m=" << m << ", n=" << n << ", k=" << k
                                      << " on this GPU (FP8 tensor cores need sm_89 or newer)";
      p.algo = result.algo;
      found = lib.plans.emplace(key, p).first;
    }
    plan = found->second;
  }
  cudaStream stream = TVMFFIEnvGetStream(kDLCUDA, device_id);
  const float alpha = 1.0f, beta = 0.0f;
  CheckLt(lib.matmul(handle, plan.desc, &alpha, DataPtr(w), plan.a, DataPtr(x), plan.b, &beta, DataPtr(out),
                     plan.d, DataPtr(out), plan.d, &plan.algo, nullptr, 0, stream),
          "cublasLtMatmul", m, n, k);
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(vtool_cublas_gemm_nt, GemmNT);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(vtool_cublaslt_fp8_gemm_nt, Fp8GemmNT);
