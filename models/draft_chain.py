"""A draft model's decode step with nothing on the host between tokens (speculative decoding).

A draft model proposes k tokens per round for one sequence. Through the engine each of them is a
whole `decode` call: TVM's paged KV cache stages each step's page table from the host, and its
attention runs between the captured pieces, about 1 ms a call on an H200 whatever the model's size
(docs/BENCHMARKS.md, issue 15), which costs more than the target saves. These entry points keep the
draft's keys and values in a cache of its own instead, one contiguous row of positions per layer
(`k_cache`, `v_cache`: [layers, CACHE_LEN, kv_heads, head_dim], owned by the runtime), and read
every per-step value from a small int32 `state` tensor on the device, so a step has only fixed
inputs: a CUDA build captures `draft_step` whole in one graph, and k drafts are k graph launches
queued without a wait.

    draft_extend(input_ids[n], position[1], k_cache, v_cache)
        the keys and values of n tokens from `position` on (a prompt, or a round's catch-up)
    draft_step(state[STATE_LEN], k_cache, v_cache) -> token[1]
        one token: j = state[STEP]; it feeds state[FORCED + j] while j < state[NUM_FORCED], else
        the token step j - 1 drew, at position state[POSITION] + j; writes the greedy argmax of its
        logits to state[OUT + j] and state[STEP] = j + 1

The kernels here are plain TIR (what a CPU build runs, and the tests check); on CUDA the
DraftChain schedule rule (schedules/cuda/draft_chain.py) puts scheduled forms in their place,
found by their block names. Rotary embeddings are applied here (the paged cache applies them
inside its kernels); configurations whose attention this cannot reproduce are refused by
`unsupported_reason`.
"""
from __future__ import annotations

import numpy as np
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.script import tirx as T

from vtool.models.config import ModelConfig
from vtool.models.rope import apply_rope, inverse_frequencies

# the state tensor's layout (a contract with the runtime)
from vtool.runtime.artifact.draft_state import (FORCED, MAX_FORCED, MAX_STEPS, NUM_FORCED, OUT,  # noqa: F401
                                                MAX_VERIFY, PART_ACC, PART_MAX, PART_SUM, POSITION, SPLITS,
                                                STATE_LEN, STEP, V_OUT, V_POSITION, V_TOKENS, VERIFY_STATE_LEN)

EXTEND_ENTRY = "draft_extend"
STEP_ENTRY = "draft_step"
VERIFY_ENTRY = "chain_verify"


def unsupported_reason(c: ModelConfig) -> str | None:
    """Why this model's attention cannot run on the draft cache; None when it can."""
    if c.sliding_window:
        return "its layers attend over a sliding window"
    if c.attn_logit_softcap:
        return "its attention soft-caps the scores"
    if c.rope_scaling and not c.model_rope:
        return f"its rope scaling {c.rope_scaling.get('rope_type')!r} is applied only by the paged cache's kernels"
    if c.rotary_dim and c.rotary_dim != c.head_dim and not c.model_rope:
        return "it rotates part of each head"
    return None


# -- plain TIR kernels ---------------------------------------------------------------------------

def write_kv_func(layers: int, cache_len: int, kv_heads: int, head_dim: int, q_heads: int, dtype: str) -> tirx.PrimFunc:
    """write(k_cache, v_cache, qkv[s, q_heads + 2 kv_heads, D], inv_freq[D / 2], base[1], layer): row
    base + i of `layer` takes token i's key, rotated to position base + i as models/rope.py's
    apply_rope rotates (all zeros in inv_freq: the key as it is, for models that rotate their own),
    and its value, both read from the fused q|k|v (in place)."""
    L, C, H, D, HQ = layers, cache_len, kv_heads, head_dim, q_heads
    HALF = D // 2

    @T.prim_func(s_tir=True)
    def write(kc_h: T.handle, vc_h: T.handle, qkv_h: T.handle, freq_h: T.handle, base_h: T.handle, layer: T.int64):
        T.func_attr({"tirx.noalias": True})
        s = T.int64()
        kc = T.match_buffer(kc_h, (L, C, H, D), dtype)
        vc = T.match_buffer(vc_h, (L, C, H, D), dtype)
        qkv = T.match_buffer(qkv_h, (s, HQ + 2 * H, D), dtype)
        freq = T.match_buffer(freq_h, (HALF,), "float32")
        base = T.match_buffer(base_h, (1,), "int32")
        for i, h, d in T.grid(s, H, D):
            with T.sblock("draft_chain_write"):
                vi, vh, vd = T.axis.remap("SSS", [i, h, d])
                T.reads(qkv[vi, HQ + vh, 0:D], qkv[vi, HQ + H + vh, vd], freq[0:HALF], base[0])
                T.writes(kc[layer, 0:C, vh, vd], vc[layer, 0:C, vh, vd])
                angle: T.let[T.float32] = T.cast(base[0] + T.cast(vi, "int32"), "float32") * freq[vd % HALF]
                other: T.let[T.float32] = T.if_then_else(vd < HALF, -T.cast(qkv[vi, HQ + vh, vd + HALF], "float32"),
                                                         T.cast(qkv[vi, HQ + vh, vd - HALF], "float32"))
                kc[layer, T.cast(base[0], "int64") + vi, vh, vd] = T.cast(
                    T.cast(qkv[vi, HQ + vh, vd], "float32") * T.cos(angle) + other * T.sin(angle), dtype)
                vc[layer, T.cast(base[0], "int64") + vi, vh, vd] = qkv[vi, HQ + H + vh, vd]

    return write


def attention_part_func(layers: int, cache_len: int, q_heads: int, kv_heads: int, head_dim: int, dtype: str,
                        splits: int = SPLITS) -> tirx.PrimFunc:
    """attend_part(q[s, q_heads, D], k_cache, v_cache, base[1], layer, scale) -> part[s, q_heads, splits, 2 + D]:
    query i (at position base + i) attends over rows 0..base + i of `layer` in `splits` pieces; piece p
    keeps its softmax state (max score, sum of exp(score - max), the weighted sum of values; float32,
    natural log units; an empty piece: max -3e38, sum 0). attention_merge_func joins the pieces."""
    L, C, HQ, HKV, D, P = layers, cache_len, q_heads, kv_heads, head_dim, splits
    group = HQ // HKV

    @T.prim_func(s_tir=True)
    def attend_part(q_h: T.handle, kc_h: T.handle, vc_h: T.handle, base_h: T.handle, layer: T.int64,
                    scale: T.float32, part_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        s = T.int64()
        q = T.match_buffer(q_h, (s, HQ, D), dtype)
        kc = T.match_buffer(kc_h, (L, C, HKV, D), dtype)
        vc = T.match_buffer(vc_h, (L, C, HKV, D), dtype)
        base = T.match_buffer(base_h, (1,), "int32")
        part = T.match_buffer(part_h, (s, HQ, P, PART_ACC + D), "float32")
        for i, h, p in T.grid(s, HQ, P):
            with T.sblock("draft_chain_attention_part"):
                vi, vh, vp = T.axis.remap("SSS", [i, h, p])
                T.reads(q[vi, vh, 0:D], kc[layer, 0:C, vh // group, 0:D], vc[layer, 0:C, vh // group, 0:D], base[0])
                T.writes(part[vi, vh, vp, 0:PART_ACC + D])
                acc = T.sblock_alloc_buffer((D,), "float32")
                st = T.sblock_alloc_buffer((3,), "float32")  # running max, running sum, score
                n: T.let[T.int64] = T.cast(base[0], "int64") + vi + 1
                chunk: T.let[T.int64] = T.ceildiv(n, P)
                start: T.let[T.int64] = vp * chunk
                for d in range(D):
                    acc[d] = T.float32(0)
                st[0] = T.float32(-3.0e38)
                st[1] = T.float32(0)
                for t in range(start, T.max(T.min(start + chunk, n), start)):
                    st[2] = T.float32(0)
                    for d in range(D):
                        st[2] = st[2] + T.cast(q[vi, vh, d], "float32") * T.cast(kc[layer, t, vh // group, d], "float32")
                    st[2] = st[2] * scale
                    m_new: T.let[T.float32] = T.max(st[0], st[2])
                    rescale: T.let[T.float32] = T.exp(st[0] - m_new)
                    w: T.let[T.float32] = T.exp(st[2] - m_new)
                    st[1] = st[1] * rescale + w
                    for d in range(D):
                        acc[d] = acc[d] * rescale + w * T.cast(vc[layer, t, vh // group, d], "float32")
                    st[0] = m_new
                part[vi, vh, vp, PART_MAX] = st[0]
                part[vi, vh, vp, PART_SUM] = st[1]
                for d in range(D):
                    part[vi, vh, vp, PART_ACC + d] = acc[d]

    return attend_part


def attention_merge_func(q_heads: int, head_dim: int, dtype: str, splits: int = SPLITS) -> tirx.PrimFunc:
    """attend_merge(part[s, q_heads, splits, 2 + D]) -> o[s, q_heads, D]: the pieces' softmax states
    joined (piece 0 is never empty, so the joint max is a real score's)."""
    HQ, D, P = q_heads, head_dim, splits

    @T.prim_func(s_tir=True)
    def attend_merge(part_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        s = T.int64()
        part = T.match_buffer(part_h, (s, HQ, P, PART_ACC + D), "float32")
        o = T.match_buffer(o_h, (s, HQ, D), dtype)
        for i, h in T.grid(s, HQ):
            with T.sblock("draft_chain_attention_merge"):
                vi, vh = T.axis.remap("SS", [i, h])
                T.reads(part[vi, vh, 0:P, 0:PART_ACC + D])
                T.writes(o[vi, vh, 0:D])
                st = T.sblock_alloc_buffer((3,), "float32")  # joint max, joint sum, acc
                st[0] = T.float32(-3.0e38)
                for p in range(P):
                    st[0] = T.max(st[0], part[vi, vh, p, PART_MAX])
                for d in range(D):
                    st[1] = T.float32(0)
                    st[2] = T.float32(0)
                    for p in range(P):
                        w: T.let[T.float32] = T.exp(part[vi, vh, p, PART_MAX] - st[0])
                        st[1] = st[1] + part[vi, vh, p, PART_SUM] * w
                        st[2] = st[2] + part[vi, vh, p, PART_ACC + d] * w
                    o[vi, vh, d] = T.cast(st[2] / st[1], dtype)

    return attend_merge


def select_func() -> tirx.PrimFunc:
    """select(state) -> (token[1], position[1]) of the step state[STEP] names."""

    @T.prim_func(s_tir=True)
    def select(state_h: T.handle, token_h: T.handle, pos_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        state = T.match_buffer(state_h, (STATE_LEN,), "int32")
        token = T.match_buffer(token_h, (1,), "int32")
        pos = T.match_buffer(pos_h, (1,), "int32")
        for _ in range(1):  # a loop over the block, for the CUDA form's thread binding
            with T.sblock("draft_chain_select"):
                T.reads(state[0:STATE_LEN])
                T.writes(token[0], pos[0])
                j: T.let[T.int32] = state[STEP]
                token[0] = T.if_then_else(j < state[NUM_FORCED], state[FORCED + T.min(j, MAX_FORCED - 1)],
                                          state[OUT + T.max(j - 1, 0)])
                pos[0] = state[POSITION] + j

    return select


def last_token_func() -> tirx.PrimFunc:
    """last(state) -> [1]: the token the latest step drew (a fresh tensor: see last_token)."""

    @T.prim_func(s_tir=True)
    def last(state_h: T.handle, token_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        state = T.match_buffer(state_h, (STATE_LEN,), "int32")
        token = T.match_buffer(token_h, (1,), "int32")
        for _ in range(1):
            with T.sblock("draft_chain_last"):
                T.reads(state[0:STATE_LEN])
                T.writes(token[0])
                token[0] = state[OUT + T.min(T.max(state[STEP] - 1, 0), MAX_STEPS - 1)]

    return last


def record_argmax_func(vocab: int) -> tirx.PrimFunc:
    """record(state, logits[1, 1, V]): state[OUT + state[STEP]] = the argmax (the lowest index
    among equal maxima, as numpy's), then state[STEP] += 1 (in place)."""
    V = vocab

    @T.prim_func(s_tir=True)
    def record(state_h: T.handle, x_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        state = T.match_buffer(state_h, (STATE_LEN,), "int32")
        x = T.match_buffer(x_h, (1, 1, V), "float32")
        with T.sblock("draft_chain_argmax"):
            T.reads(state[0:STATE_LEN], x[0, 0, 0:V])
            T.writes(state[0:STATE_LEN])
            best = T.sblock_alloc_buffer((1,), "float32")
            at = T.sblock_alloc_buffer((1,), "int32")
            best[0] = x[0, 0, 0]
            at[0] = 0
            for t in range(1, V):
                if x[0, 0, t] > best[0]:
                    best[0] = x[0, 0, t]
                    at[0] = T.int32(t)
            state[OUT + T.min(state[STEP], MAX_STEPS - 1)] = at[0]
            state[STEP] = state[STEP] + 1

    return record


def verify_inputs_func() -> tirx.PrimFunc:
    """inputs(state) -> (tokens[MAX_VERIFY], position[1]) of a chain_verify call."""

    @T.prim_func(s_tir=True)
    def inputs(state_h: T.handle, token_h: T.handle, pos_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        state = T.match_buffer(state_h, (VERIFY_STATE_LEN,), "int32")
        token = T.match_buffer(token_h, (MAX_VERIFY,), "int32")
        pos = T.match_buffer(pos_h, (1,), "int32")
        for r in range(MAX_VERIFY):
            with T.sblock("chain_verify_inputs"):
                vr = T.axis.spatial(MAX_VERIFY, r)
                T.reads(state[0:VERIFY_STATE_LEN])
                T.writes(token[vr], pos[0])
                token[vr] = state[V_TOKENS + vr]
                if vr == 0:
                    pos[0] = state[V_POSITION]

    return inputs


def rows_argmax_func(rows: int, vocab: int) -> tirx.PrimFunc:
    """argmax(state, logits[1, rows, V]): state[V_OUT + r] = row r's argmax (the lowest index among
    equal maxima, as numpy's) (in place)."""
    R, V = rows, vocab

    @T.prim_func(s_tir=True)
    def argmax(state_h: T.handle, x_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        state = T.match_buffer(state_h, (VERIFY_STATE_LEN,), "int32")
        x = T.match_buffer(x_h, (1, R, V), "float32")
        for r in range(R):
            with T.sblock("chain_verify_argmax"):
                vr = T.axis.spatial(R, r)
                T.reads(x[0, vr, 0:V])
                T.writes(state[V_OUT + vr])
                best = T.sblock_alloc_buffer((1,), "float32")
                at = T.sblock_alloc_buffer((1,), "int32")
                best[0] = x[0, vr, 0]
                at[0] = 0
                for t in range(1, V):
                    if x[0, vr, t] > best[0]:
                        best[0] = x[0, vr, t]
                        at[0] = T.int32(t)
                state[V_OUT + vr] = at[0]

    return argmax


def verify_out_func() -> tirx.PrimFunc:
    """out(state) -> [MAX_VERIFY]: the rows' greedy tokens as a new tensor (see last_token)."""

    @T.prim_func(s_tir=True)
    def out(state_h: T.handle, token_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        state = T.match_buffer(state_h, (VERIFY_STATE_LEN,), "int32")
        token = T.match_buffer(token_h, (MAX_VERIFY,), "int32")
        for r in range(MAX_VERIFY):
            with T.sblock("chain_verify_out"):
                vr = T.axis.spatial(MAX_VERIFY, r)
                token[vr] = state[V_OUT + vr]

    return out


# -- the cache the decoder layers attend through -------------------------------------------------

class ContiguousKV:
    """What models/decoder.py's Attention asks of a KV cache (attention_with_fused_qkv,
    get_query_positions), over the draft's contiguous cache for `num_tokens` tokens from the
    position in `base` ([1] int32, on the device)."""

    def __init__(self, c: ModelConfig, dtype: str, k_cache: Tensor, v_cache: Tensor, base: Tensor, num_tokens: int | tirx.PrimExpr):
        self.config, self.dtype = c, dtype
        self.k_cache, self.v_cache, self.base, self.num_tokens = k_cache, v_cache, base, num_tokens
        layers, cache_len, kv_heads, head_dim = (int(x) for x in k_cache.shape)
        self._write = write_kv_func(layers, cache_len, kv_heads, head_dim, c.num_attention_heads, dtype)
        self._attend_part = attention_part_func(layers, cache_len, c.num_attention_heads, kv_heads, head_dim, dtype)
        self._attend_merge = attention_merge_func(c.num_attention_heads, head_dim, dtype)
        self._inv_freq = None if c.model_rope else inverse_frequencies(head_dim, c.rope_theta)
        self._positions: Tensor | None = None
        self._freq: Tensor | None = None

    def get_query_positions(self, n: int | tirx.PrimExpr) -> Tensor:
        if self._positions is None:
            def positions(b: te.Tensor) -> te.Tensor:
                return te.compute((n,), lambda i: b[0] + i.astype("int32"), name="draft_chain_positions")

            self._positions = op.tensor_expr_op(positions, name_hint="draft_chain_positions", args=[self.base])
        return self._positions

    def attention_with_fused_qkv(self, layer_id: int, qkv: Tensor, num_qo_heads: int, sm_scale: float) -> Tensor:
        b, s, heads, d = qkv.shape
        flat = op.reshape(qkv, (b * s, heads, d))
        # the queries rotated and the keys rotated into the cache straight from q|k|v: no split kernels
        if self._inv_freq is not None:  # the paged cache's RopeMode.NORMAL, done here
            q = apply_rope(flat, self.get_query_positions(b * s), self._inv_freq, heads=(0, num_qo_heads))
        else:  # the model rotated q and k itself
            q = op.split(flat, [num_qo_heads], axis=1)[0]
        if self._freq is None:
            self._freq = Tensor.from_const(self._inv_freq if self._inv_freq is not None
                                           else np.zeros(int(d) // 2, np.float32))
        freq = self._freq
        layer = tirx.IntImm("int64", layer_id)
        self.k_cache, self.v_cache = op.tensor_ir_inplace_op(
            self._write, "draft_chain_write", [self.k_cache, self.v_cache, flat, freq, self.base, layer], [0, 1],
            [Tensor.placeholder(self.k_cache.shape, self.dtype), Tensor.placeholder(self.v_cache.shape, self.dtype)])
        part = op.tensor_ir_op(self._attend_part, "draft_chain_attention_part",
                               [q, self.k_cache, self.v_cache, self.base, layer, tirx.FloatImm("float32", sm_scale)],
                               Tensor.placeholder((b * s, num_qo_heads, SPLITS, PART_ACC + d), "float32"))
        o = op.tensor_ir_op(self._attend_merge, "draft_chain_attention_merge", [part],
                            Tensor.placeholder((b * s, num_qo_heads, d), self.dtype))
        return op.reshape(o, (b, s, num_qo_heads, d))


def select(state: Tensor) -> tuple[Tensor, Tensor]:
    token, pos = op.tensor_ir_op(select_func(), "draft_chain_select", [state],
                                 [Tensor.placeholder((1,), "int32"), Tensor.placeholder((1,), "int32")])
    return token, pos


def record_argmax(state: Tensor, logits: Tensor) -> Tensor:
    return op.tensor_ir_inplace_op(record_argmax_func(int(logits.shape[-1])), "draft_chain_argmax", [state, logits],
                                   0, Tensor.placeholder((STATE_LEN,), "int32"))


def last_token(state: Tensor) -> Tensor:
    """The step's result as a new tensor. draft_step returns this rather than `state` itself: in
    TVM 0.27 a CUDA-graph region whose last value is the function's return value is lifted without
    exporting it (the VM codegen then fails on an undefined variable), so the graph must end
    before one more kernel whose output is the function's own (outside the graph)."""
    return op.tensor_ir_op(last_token_func(), "draft_chain_last", [state], Tensor.placeholder((1,), "int32"))


def verify_inputs(state: Tensor) -> tuple[Tensor, Tensor]:
    return op.tensor_ir_op(verify_inputs_func(), "chain_verify_inputs", [state],
                           [Tensor.placeholder((MAX_VERIFY,), "int32"), Tensor.placeholder((1,), "int32")])


def verify_argmax(state: Tensor, logits: Tensor) -> Tensor:
    rows, vocab = int(logits.shape[1]), int(logits.shape[2])
    return op.tensor_ir_inplace_op(rows_argmax_func(rows, vocab), "chain_verify_argmax", [state, logits], 0,
                                   Tensor.placeholder((VERIFY_STATE_LEN,), "int32"))


def verify_out(state: Tensor) -> Tensor:
    return op.tensor_ir_op(verify_out_func(), "chain_verify_out", [state],
                           Tensor.placeholder((MAX_VERIFY,), "int32"))


def cache_spec(c: ModelConfig, dtype: str, cache_len: int) -> nn.spec.Tensor:
    return nn.spec.Tensor([c.num_hidden_layers, cache_len, c.num_key_value_heads, c.head_dim], dtype)


def entry_specs(c: ModelConfig, dtype: str, cache_len: int) -> dict:
    """The two entry points' specs (models/decoder.py adds them when the build asks)."""
    packed = {"param_mode": "packed", "effect_mode": "none"}
    cache = {"k_cache": cache_spec(c, dtype, cache_len), "v_cache": cache_spec(c, dtype, cache_len)}
    return {
        EXTEND_ENTRY: {"input_ids": nn.spec.Tensor(["seq_len"], "int32"), "position": nn.spec.Tensor([1], "int32"),
                       **cache, "$": packed},
        STEP_ENTRY: {"state": nn.spec.Tensor([STATE_LEN], "int32"), **cache, "$": packed},
        VERIFY_ENTRY: {"state": nn.spec.Tensor([VERIFY_STATE_LEN], "int32"), **cache, "$": packed},
    }
