/* vtool's build-time stand-in for the CUDA driver (libcuda.so.1).
 *
 * TVM's libtvm_runtime_cuda.so links libcuda.so.1. On a machine without a GPU driver it
 * fails to load, and TVM's CUDA codegen then embeds CUDA C source instead of compiled
 * code. vtool compiles this file into the user cache (never shipped, never installed)
 * and puts it on LD_LIBRARY_PATH of the compile subprocess only. Every entry point fails
 * with CUDA_ERROR_NO_DEVICE (100); compilation never calls the driver. */
typedef int CUresult;
int vtool_stub_marker = 1; /* lets vtool tell this stub from a real driver */
static const char *stub_message = "vtool build-time CUDA driver stub (no GPU)";
CUresult cuGetErrorName(CUresult e, const char **s) { (void)e; if (s) *s = "CUDA_ERROR_NO_DEVICE"; return 0; }
CUresult cuGetErrorString(CUresult e, const char **s) { (void)e; if (s) *s = stub_message; return 0; }
#define STUB(name) CUresult name(void) { return 100; }
STUB(cuInit) STUB(cuDriverGetVersion) STUB(cuDeviceGet) STUB(cuDeviceGetCount) STUB(cuDeviceGetName)
STUB(cuDeviceGetAttribute) STUB(cuCtxGetCurrent) STUB(cuCtxSetCurrent) STUB(cuDevicePrimaryCtxRetain)
STUB(cuModuleLoadData) STUB(cuModuleUnload) STUB(cuModuleGetFunction) STUB(cuModuleGetGlobal)
STUB(cuFuncSetAttribute) STUB(cuLaunchKernel) STUB(cuLaunchKernelEx) STUB(cuLaunchCooperativeKernel)
STUB(cuTensorMapEncodeTiled) STUB(cuGetProcAddress) STUB(cuGetProcAddress_v2)
