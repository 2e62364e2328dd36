"""Linear layers with FP8 (e4m3) weights and a float32 scale per output row (`--quantization fp8`).

The layout is runtime/weights/fp8.py's: weight float8_e4m3fn [out, in], weight_scale float32
[out]. Two ways to multiply, picked per matmul when the model is traced:

  W8A16 (one sequence's decode step; every matmul off the FP8 tensor cores):
         y = (x . f(W)^T) * s, where f widens e4m3 exactly. In decode f is inside the GEMV,
         which reads one byte a weight, half of bf16's; elsewhere (CPU prompts, sm_80) the
         weight is widened into a temporary for the dense matmul. The row scale multiplies the
         float32 sum once.
  W8A8  (prompts, batched decode and verification, where `fp8_tensor_cores` is set: CUDA sm_89
         and newer with cuBLAS matmuls):
         x is quantized per row (token) to e4m3 with its own scale, xs = max|x[row]| / 448, and
         the e4m3 x e4m3 product is summed in float32 by the FP8 tensor cores (cuBLASLt, through
         toolchain/gemm_offload.py): y = (xq . W^T) * xs[:, None] * s[None, :]. As vLLM's fp8
         with dynamic per-token activation scales.

Both accumulate in float32 and cast the result to the compute dtype once, as Linear does.
"""
from __future__ import annotations

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from vtool.models.quantized_linear import set_in_modules
from vtool.runtime.weights.fp8_layout import E4M3_MAX, FP8_DTYPE, SCALE_DTYPE, fits

ACT_SCALE_BLOCK = "vtool_fp8_act_scale"
ACT_QUANT_BLOCK = "vtool_fp8_act_quant"
MATMUL_BLOCK = "vtool_fp8_matmul"


def _act_scale_te(x: te.Tensor) -> te.Tensor:
    """Per row of x [..., K]: max|x| / 448, float32 [...]; 1 where that is 0 (a row of zeros, or of
    values so small the scale underflows), which quantizes the row to zeros, not to nan."""
    *lead, k = x.shape
    r = te.reduce_axis((0, k), name="k")
    amax = te.compute(tuple(lead), lambda *i: te.max(tirx.abs(x[(*i, r)].astype("float32")), axis=r),
                      name=ACT_SCALE_BLOCK + "_amax")
    zero = tirx.const(0.0, "float32")

    def scale(*i):
        s = amax[i] / tirx.const(E4M3_MAX, "float32")
        return tirx.Select(s > zero, s, tirx.const(1.0, "float32"))

    return te.compute(tuple(lead), scale, name=ACT_SCALE_BLOCK)


def _act_quant_te(x: te.Tensor, scale: te.Tensor) -> te.Tensor:
    """x / scale[row] rounded to e4m3 (|value| <= 448 by the scale's choice; clamped for
    float32's rounding of the division)."""
    hi = tirx.const(E4M3_MAX, "float32")

    def q(*i):
        v = x[i].astype("float32") / scale[i[:-1]]
        return tirx.max(tirx.min(v, hi), -hi).astype(FP8_DTYPE)

    return te.compute(tuple(x.shape), q, name=ACT_QUANT_BLOCK)


def _matmul_te(x: te.Tensor, w: te.Tensor) -> te.Tensor:
    """x [..., K] . widen(w [N, K])^T -> [..., N] float32, the weight widened inside the reduction:
    one kernel that reads each e4m3 byte once. (As relax ops, astype then matmul, FuseOps keeps
    the astype a kernel of its own: the whole weight written out in the compute dtype every step.)"""
    *lead, k = x.shape
    r = te.reduce_axis((0, k), name="k")
    return te.compute((*lead, w.shape[0]),
                      lambda *i: te.sum(x[(*i[:-1], r)].astype("float32") * w[i[-1], r].astype("float32"), axis=r),
                      name=MATMUL_BLOCK)


class Fp8Linear(nn.Module):
    """y = x . (W_q * s)^T (+ b), Linear's contract (float32 accumulation, output in the compute
    dtype) with the weight kept as e4m3 and a row scale."""

    # Set for the whole model by use_fp8_tensor_cores (toolchain: CUDA targets with FP8 tensor
    # cores and cuBLAS matmuls): matmuls over more than decode's one row per sequence take W8A8.
    fp8_tensor_cores: bool = False

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: str):
        if not fits(out_features, in_features):
            raise ValueError(f"a [{out_features}, {in_features}] weight cannot be kept in FP8 (columns a multiple "
                             "of 16)")
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter((out_features, in_features), FP8_DTYPE)
        self.weight_scale = nn.Parameter((out_features,), SCALE_DTYPE)
        self.bias = nn.Parameter((out_features,), dtype) if bias else None
        self.compute_dtype = dtype

    def forward(self, x: Tensor, prompt: bool = False) -> Tensor:
        # one sequence's decode step ([1, 1]): the GEMV, which reads each weight byte once. A
        # symbolic batch ([b, 1]: batch_decode) or a prompt takes the tensor cores when it can.
        one_row = not prompt and all(isinstance(d, int) and d == 1 for d in x.shape[:-1])
        if self.fp8_tensor_cores and not one_row:
            xs = op.tensor_expr_op(_act_scale_te, "fp8_act_scale", [x])
            xq = op.tensor_expr_op(_act_quant_te, "fp8_act_quant", [x, xs])
            y = op.matmul(xq, op.permute_dims(self.weight), out_dtype="float32")
            y = y * op.unsqueeze(xs, -1)
        elif one_row:
            y = op.tensor_expr_op(_matmul_te, "fp8_matmul", [x, self.weight])
        else:  # the weight widened into a temporary, then the dense matmul (cuBLAS on a GPU)
            w = op.astype(self.weight, x.dtype)  # exact: every e4m3 value is a bf16, f16 and f32 value
            y = op.matmul(x, op.permute_dims(w), out_dtype="float32")
        y = y * self.weight_scale
        if self.compute_dtype != "float32":
            y = y.astype(self.compute_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y


def use_fp8_tensor_cores(model: nn.Module) -> int:
    """Make every Fp8Linear in `model` take W8A8 over prompt and batch rows; returns how many."""
    return set_in_modules(model, Fp8Linear, fp8_tensor_cores=True)

