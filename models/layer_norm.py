"""LayerNorm for any compute dtype (GPT-2, BERT).

TVM 0.27's layer_norm operator takes float32 and float16 only: a bfloat16 build fails when
the operator is lowered ("layer_norm: only support float32 and float16"). A bfloat16 model
therefore normalizes in float32 and rounds the result back, which is also what torch's
bfloat16 LayerNorm does inside (it accumulates the mean and variance in float32).
"""
from __future__ import annotations

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters, `weight` and `bias`) that runs bfloat16 in float32."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != "bfloat16":
            return super().forward(x)
        weight = self.weight.astype("float32") if self.weight is not None else None
        bias = self.bias.astype("float32") if self.bias is not None else None
        y = op.layer_norm(x.astype("float32"), normalized_shape=self.normalized_shape, weight=weight, bias=bias,
                          eps=self.eps)
        return y.astype("bfloat16")
