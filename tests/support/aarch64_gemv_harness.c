/* Runs one vtool decode GEMV (a TVM FFI kernel: A[1,1,K] x W[N,K]^T -> C[1,1,N]) linked statically
   for aarch64, under qemu-user (tests/test_aarch64.py). TVM's thread pool is replaced by a serial
   loop over NTASK task ids, so the kernel's parallel split is exercised too. stdin: A then W
   (float32); stdout: C. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <tvm/ffi/c_api.h>
#include <dlpack/dlpack.h>

typedef struct { void* sync_handle; int32_t num_task; } Env;
typedef int (*FLambda)(int, Env*, void*);
extern int (*__TVMBackendParallelLaunch)(FLambda, void*, int);
extern int KERNEL(void*, const TVMFFIAny*, int32_t, TVMFFIAny*);

void TVMFFIErrorSetRaisedFromCStrParts(const char* kind, const char** parts, int32_t n) {
  fprintf(stderr, "kernel error %s:", kind); for (int i = 0; i < n; i++) fprintf(stderr, " %s", parts[i]);
  fprintf(stderr, "\n"); exit(3);
}
static int tasks_run = 0;
static int launch(FLambda f, void* cdata, int num_task) {  /* serial, NTASK task ids */
  Env env = {0, NTASK};
  for (int t = 0; t < NTASK; t++) { tasks_run++; int r = f(t, &env, cdata); if (r) return r; }
  return 0;
}
static DLTensor tensor(float* data, int ndim, int64_t* shape) {
  DLTensor t; memset(&t, 0, sizeof t);
  t.data = data; t.device.device_type = kDLCPU; t.ndim = ndim; t.dtype.code = kDLFloat; t.dtype.bits = 32;
  t.dtype.lanes = 1; t.shape = shape; return t;
}
int main(void) {
  float *a = aligned_alloc(64, K * 4), *w = aligned_alloc(64, (size_t)N * K * 4), *c = aligned_alloc(64, N * 4);
  if (fread(a, 4, K, stdin) != K || fread(w, 4, (size_t)N * K, stdin) != (size_t)N * K) return 4;
  int64_t sa[3] = {1, 1, K}, sw[2] = {N, K}, sc[3] = {1, 1, N};
  DLTensor ta = tensor(a, 3, sa), tw = tensor(w, 2, sw), tc = tensor(c, 3, sc);
  TVMFFIAny args[3]; memset(args, 0, sizeof args);
  args[0].type_index = kTVMFFIDLTensorPtr; args[0].v_ptr = &ta;
  args[1].type_index = kTVMFFIDLTensorPtr; args[1].v_ptr = &tw;
  args[2].type_index = kTVMFFIDLTensorPtr; args[2].v_ptr = &tc;
  __TVMBackendParallelLaunch = launch;
  TVMFFIAny ret; memset(&ret, 0, sizeof ret);
  int rc = KERNEL(NULL, args, 3, &ret);
  fprintf(stderr, "rc=%d tasks=%d\n", rc, tasks_run);
  fwrite(c, 4, N, stdout);
  return rc;
}
