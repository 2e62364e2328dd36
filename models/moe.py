"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral) in tvm.relax.frontend.nn.

    logits = x Wr^T                          router, [T, E], then float32
    idx, w = moe_route(logits)               softmax over E, the top k (ties to the lower
                                             expert), w renormalized to sum 1 if norm_topk_prob
    gu     = moe_gemv(x, gate_up, idx)       [T, k, 2I]: token t times expert idx[t, j]'s gate|up
    a      = silu(gate) * up                 [T, k, I]
    y      = moe_gemv(a, down, idx)          [T, k, H]: each (t, j) row times its expert's down
    out    = sum_j w[t, j] * y[t, j]         [T, H]

Every token runs its own top-k experts: moe_gemv reads W[idx[t, j]] and nothing else, so a
batch-1 decode step reads k of the E experts' weights (tests/bench/moe_bytes.py counts it). A
prompt of T tokens reads up to T * k expert matrices (a grouped GEMM would read each chosen
expert once; correctness first). The kernels are written here target-free, with block names
the schedules find them by (schedules/cpu/moe.py, schedules/cuda/moe.py: GEMV_BLOCK,
ROUTE_BLOCK); products accumulate in float32 whatever the weight dtype.

Parameters (models/moe_weights.py binds them): mlp.gate.weight [E, H], mlp.experts.gate_up_proj
[E, 2I, H] (expert e's gate rows, then its up rows), mlp.experts.down_proj [E, H, I].
"""
from __future__ import annotations

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.script import tirx as T

from vtool.models.config import ModelConfig

GEMV_BLOCK = "moe_gemv"
ROUTE_BLOCK = "moe_route"


def gather_gemv(rows: int, top_k: int, out_features: int, in_features: int, experts: int,
                x_dtype: str, w_dtype: str) -> tirx.PrimFunc:
    """out[t, j, n] = sum_c x[t, j or 0, c] * w[idx[t, j], n, c], float32. x is [T, rows, K]:
    rows 1 (every chosen expert sees the token's row) or top_k (row j goes to expert idx[t, j])."""
    # Every extent int64, as the token count: with int32 ones beside the int64 token loop, TVM
    # 0.27's LowerCrossThreadReduction silently leaves a CUDA schedule's lanes racing on one
    # output (every MoE model was wrong on the H200 until this; tests/support/moe_probe.py).
    t_len = tirx.Var("n", "int64")
    rows_, top_k_, out_, in_, experts_ = (tirx.IntImm("int64", v) for v in
                                          (rows, top_k, out_features, in_features, experts))
    x = te.placeholder((t_len, rows_, in_), x_dtype, name="x")
    w = te.placeholder((experts_, out_, in_), w_dtype, name="w")
    idx = te.placeholder((t_len, top_k_), "int32", name="idx")
    c = te.reduce_axis((tirx.IntImm("int64", 0), in_), name="c")

    def body(t, j, n):
        xv = x[t, j if rows > 1 else 0, c]
        wv = w[idx[t, j], n, c]
        return te.sum(xv.astype("float32") * wv.astype("float32"), axis=c)

    out = te.compute((t_len, top_k_, out_), body, name=GEMV_BLOCK)
    # opaque: never fused with its neighbours; no global symbol: the exporter names each copy
    return te.create_prim_func([x, w, idx, out]).with_attr("op_pattern", 8).without_attr("global_symbol")


def router(experts: int, top_k: int, renormalize: bool) -> tirx.PrimFunc:
    """Per token: softmax of its float32 router logits, the top_k probabilities (repeated argmax,
    ties to the lower expert id, as torch.topk on distinct values), renormalized to sum 1 if asked."""
    E, K = experts, top_k

    @T.prim_func(s_tir=True)
    def route(logits_h: T.handle, idx_h: T.handle, w_h: T.handle):
        T.func_attr({"op_pattern": 8, "tirx.noalias": True})
        n = T.int64()
        logits = T.match_buffer(logits_h, (n, E), "float32")
        idx = T.match_buffer(idx_h, (n, K), "int32")
        w = T.match_buffer(w_h, (n, K), "float32")
        for t in range(n):
            with T.sblock(ROUTE_BLOCK):
                vt = T.axis.spatial(n, t)
                T.reads(logits[vt, 0:E])
                T.writes(idx[vt, 0:K], w[vt, 0:K])
                p = T.sblock_alloc_buffer((E,), "float32", scope="local")
                s = T.sblock_alloc_buffer((3,), "float32", scope="local")  # max, sum, best p
                b = T.sblock_alloc_buffer((1,), "int32", scope="local")
                s[0] = logits[vt, 0]
                for e in range(1, E):
                    s[0] = T.max(s[0], logits[vt, e])
                s[1] = T.float32(0)
                for e in range(E):
                    p[e] = T.exp(logits[vt, e] - s[0])
                    s[1] = s[1] + p[e]
                for e in range(E):
                    p[e] = p[e] / s[1]
                s[1] = T.float32(0)
                for j in range(K):
                    b[0] = -1
                    s[2] = T.float32(-1)
                    for e in range(E):
                        if p[e] > s[2]:
                            s[2] = p[e]
                            b[0] = e
                    idx[vt, j] = b[0]
                    w[vt, j] = s[2]
                    s[1] = s[1] + s[2]
                    p[b[0]] = T.float32(-2)  # taken
                if renormalize:
                    for j in range(K):
                        w[vt, j] = w[vt, j] / s[1]

    return route.without_attr("global_symbol")


class Experts(nn.Module):
    def __init__(self, experts: int, hidden: int, intermediate: int, dtype: str):
        self.gate_up_proj = nn.Parameter((experts, 2 * intermediate, hidden), dtype)
        self.down_proj = nn.Parameter((experts, hidden, intermediate), dtype)


class MoEMLP(nn.Module):
    """A MoE layer's MLP (what DecoderLayer uses when ModelConfig.is_moe_layer)."""

    def __init__(self, c: ModelConfig, dtype: str):
        from vtool.models.decoder import Linear  # decoder.py imports this module when it builds a MoE layer

        self.hidden, self.experts_n, self.top_k = c.hidden_size, c.num_experts, c.num_experts_per_tok
        self.intermediate, self.renormalize, self.dtype = c.moe_intermediate_size, c.norm_topk_prob, dtype
        self.gate = Linear(c.hidden_size, c.num_experts, False, dtype)
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size, dtype)

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        k, inter, dt = self.top_k, self.intermediate, self.dtype
        flat = op.reshape(x, (b * s, h))
        n = flat.shape[0]
        logits = self.gate(flat)
        if logits.dtype != "float32":
            logits = logits.astype("float32")
        idx, weights = op.tensor_ir_op(
            router(self.experts_n, k, self.renormalize), ROUTE_BLOCK, [logits],
            [Tensor.placeholder((n, k), "int32"), Tensor.placeholder((n, k), "float32")])
        gate_up = op.tensor_ir_op(
            gather_gemv(1, k, 2 * inter, h, self.experts_n, dt, dt), GEMV_BLOCK,
            [op.reshape(flat, (n, 1, h)), self.experts.gate_up_proj, idx],
            Tensor.placeholder((n, k, 2 * inter), "float32"))
        if dt != "float32":
            gate_up = gate_up.astype(dt)
        gate, up = op.split(gate_up, 2, axis=-1)
        act = op.silu(gate) * up
        y = op.tensor_ir_op(
            gather_gemv(k, k, h, inter, self.experts_n, dt, dt), GEMV_BLOCK,
            [act, self.experts.down_proj, idx], Tensor.placeholder((n, k, h), "float32"))
        if dt != "float32":
            y, weights = y.astype(dt), weights.astype(dt)
        out = op.sum(y * op.reshape(weights, (n, k, 1)), axis=1)
        return op.reshape(out, (b, s, h))
