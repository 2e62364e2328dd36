"""Parallel CPU attention kernels that apply RoPE themselves (inline rope), for the KV cache that
frees what a sliding window has passed (models/window_cache.py).

That cache keeps each sequence's last window - 1 tokens and restarts its positions at the window
once it slides, so its keys are stored unrotated and rotated at attention time from their
window-relative positions (TVM's RopeMode.INLINE: key row r of sequence b at position
k_rope_pos_offset[b] + r, query row i at q_rope_position[i]). TVM's CPU kernels for it are
serial and rotate every key again for every query and head, with a libm cos and sin per element:
at a window of 512 an 800-token prompt took 21 s instead of 0.6 s. These replace its ragged
prefill, sliding-window paged prefill and sliding-window paged decode kernels (same names and
signatures) by the parallel, vectorized kernels of schedules/cpu/attention.py with the rotation
folded into the scores:

  * RoPE depends only on the distance between query and key: R(p_q) q . R(p_k) k =
    R(p_q - p_k) q . k, and R(delta) q = q * cos(delta theta) + rot_half(q) * sin(delta theta)
    (rot_half(q) = [-q_hi, q_lo]). So each key is dotted with the query rotated by their distance,
    read from a table of cos and sin per distance and dimension, and no key is rotated at all.
  * The table is filled once per call for the distances that call needs (1 + the largest query
    position minus its sequence's key offset), by the angle-sum identities from rotations by
    multiples of STEP and by the remainders below it, made in float64 from two libm cos/sin
    pairs per frequency (`_rope_table`).
  * A distance past the table (2 * window rows: the cache's chunks are at most the window, its
    kept keys window - 1) fails loudly (a TIR assert), as does a call with any rotary mode but
    inline (1) or a non-causal ragged prefill (the cache passes neither).

The head dim must be a multiple of 16 and pages 16 keys; other kernels keep TVM's (schedules/cpu/
__init__.py).
"""
from __future__ import annotations

import re

from tvm import tirx
from tvm.script import tirx as T

from vtool.schedules.cpu.attention import (KV_DTYPES, LANES, LOG2E, NAME as RAGGED_NAME, SLIDING_DECODE_NAME,
                                          SLIDING_PREFILL_NAME, TILE, _balanced, _shape, _sliding_shapes, exp2_tile,
                                          narrow, sum_tile, vload32, widen)
from vtool.schedules.softcap import capper, softcap_of

# appended by models/window_cache.py to the names of the freeing cache's own kernels (a test
# holds the two equal: schedules never import models)
FREEING_SUFFIX = "_window_freeing"
STEP = 32  # the angle-sum split: distance = a * STEP + b
_WINDOW = re.compile(r"T\.max\((\d+) - q_idx - 1, 0\)")
_NEG = -5e4  # TVM's kernels' "minus infinity"


def window_freeing_kernels(head_dim: int) -> str:
    """What the window-freeing cache's attention runs on (CPU, pages of 16): "parallel" (these
    kernels) where the head dim is a multiple of 16, else "serial" (TVM's). Recorded in the
    manifest: the runtime frees the window by default only on the parallel ones."""
    return "parallel" if head_dim % LANES == 0 else "serial"


def freeing_window(func: tirx.PrimFunc) -> int | None:
    """The window of the freeing cache's sliding-window prefill kernel (TVM writes it into the
    kernel's mask as a constant), or None when the kernel holds no single one."""
    windows = set(_WINDOW.findall(func.script()))
    return int(windows.pop()) if len(windows) == 1 else None


def rewrite_inline_rope(name: str, func: tirx.PrimFunc, window: int) -> tirx.PrimFunc | None:
    """The parallel inline-rope replacement of the freeing cache's kernel `name` (its ragged
    prefill, sliding-window prefill or decode), or None when `func` is none of them in the form
    these kernels take. `window`: the cache's window (freeing_window)."""
    rows = 2 * window
    softcap = softcap_of(func)
    dtype = str(func.params[0].dtype)
    new = None
    if name == RAGGED_NAME + FREEING_SUFFIX:
        dims = _ragged_dims(func)
        new = _ragged_kernel(*dims, rows, softcap, dtype) if dims is not None else None
    elif name == SLIDING_PREFILL_NAME + FREEING_SUFFIX:
        dims = _sliding_shapes(func, 15, 10, 0, 2, 5)
        if dims is not None and dims[3] == LANES and freeing_window(func) == window:
            new = _prefill_kernel(dims[2], dims[0], dims[1], window, rows, softcap, dtype)
    elif name == SLIDING_DECODE_NAME + FREEING_SUFFIX:
        dims = _sliding_shapes(func, 13, 9, 0, 1, 4)
        if dims is not None and dims[3] == LANES:
            new = _decode_kernel(dims[2], dims[0], dims[1], rows, softcap, dtype)
    if new is None:
        return None
    return new.with_attrs(func.attrs) if func.attrs is not None else new


def _ragged_dims(func: tirx.PrimFunc) -> tuple[int, int, int] | None:
    """(h_kv, h_q, d) of TVM's ragged prefill kernel of the expected layout (q, k and v of one
    head dim), or None."""
    if len(func.params) != 14:
        return None
    shapes = [_shape(func, i) for i in range(14)]
    if any(s is None for s in shapes[:9]) or any(s is not None for s in shapes[9:]):
        return None
    q, k, v = shapes[0], shapes[2], shapes[3]
    if len(q) != 3 or len(k) != 3 or len(v) != 3:
        return None
    try:
        h_q, d, h_kv, d_k, d_v = int(q[1]), int(q[2]), int(k[1]), int(k[2]), int(v[2])
    except TypeError:
        return None
    if str(func.params[0].dtype) not in KV_DTYPES or h_q % h_kv or d % LANES or d_k != d or d_v != d:
        return None
    return h_kv, h_q, d


def _rope_table(d: int, rows: int):  # noqa: ANN202 - a TVMScript macro
    """Fills tab[delta, 0, :] with cos(delta * scale * inv_freq) and tab[delta, 1, :] with its sin,
    for delta < n_rows, the d / 2 frequencies twice over (q's halves rotate together); inv_freq_i =
    theta^(-2i / d), the frequencies of TVM's rope_freq_default. Each row is the product of a
    rotation by a multiple of STEP (`hi`) and one by 0 .. STEP - 1 (`lo`), both made in float64
    by repeated multiplication from one libm cos/sin pair each per frequency (the rounding grows
    by about 1e-16 a row: nothing beside float32), so a call makes 2 * d libm calls, not one per
    element (a decode step of a 512-token window spent a fifth of its time in them)."""
    half = d // 2

    @T.macro
    def fill(tab, hi, lo, inv, n_rows, rope_theta, rope_scale):
        for i in T.serial(half):
            inv[i] = T.Cast("float64", rope_scale) * T.pow(
                T.Cast("float64", rope_theta), T.Cast("float64", i) * T.float64(-2.0 / d))
            lo[0, 0, i] = T.float64(1)
            lo[0, 1, i] = T.float64(0)
            lo[1, 0, i] = T.cos(inv[i])
            lo[1, 1, i] = T.sin(inv[i])
            hi[0, 0, i] = T.float64(1)
            hi[0, 1, i] = T.float64(0)
            hi[1, 0, i] = T.cos(inv[i] * T.float64(STEP))
            hi[1, 1, i] = T.sin(inv[i] * T.float64(STEP))
        for j in T.serial(2, STEP):
            for i in T.vectorized(half):
                lo[j, 0, i] = lo[j - 1, 0, i] * lo[1, 0, i] - lo[j - 1, 1, i] * lo[1, 1, i]
                lo[j, 1, i] = lo[j - 1, 1, i] * lo[1, 0, i] + lo[j - 1, 0, i] * lo[1, 1, i]
        for a in T.serial(2, T.max((n_rows + STEP - 1) // STEP, 2)):
            for i in T.vectorized(half):
                hi[a, 0, i] = hi[a - 1, 0, i] * hi[1, 0, i] - hi[a - 1, 1, i] * hi[1, 1, i]
                hi[a, 1, i] = hi[a - 1, 1, i] * hi[1, 0, i] + hi[a - 1, 0, i] * hi[1, 1, i]
        for r in T.parallel(n_rows):
            for i in T.vectorized(half):
                tab[r, 0, i] = T.Cast("float32", hi[r // STEP, 0, i] * lo[r % STEP, 0, i]
                                      - hi[r // STEP, 1, i] * lo[r % STEP, 1, i])
                tab[r, 1, i] = T.Cast("float32", hi[r // STEP, 1, i] * lo[r % STEP, 0, i]
                                      + hi[r // STEP, 0, i] * lo[r % STEP, 1, i])
            for i in T.vectorized(half):
                tab[r, 0, i + half] = tab[r, 0, i]
                tab[r, 1, i + half] = tab[r, 1, i]

    return fill


def _load_query(d: int):  # noqa: ANN202 - a TVMScript macro
    """qv[0] = q[row, h]; qv[1] = rot_half(q[row, h]) = [-q_hi, q_lo]."""
    half = d // 2

    @T.macro
    def load(q, qv, row, h):
        for j in T.serial(half):
            qv[0, j] = widen(q[row, h, j])
            qv[0, j + half] = widen(q[row, h, j + half])
            qv[1, j] = -widen(q[row, h, j + half])
            qv[1, j + half] = widen(q[row, h, j])

    return load


def _rotated_scores(qv: tirx.Buffer, tab: tirx.Buffer, key, delta, rows: int, d: int) -> tirx.PrimExpr:  # noqa: ANN001
    """float32x16, lane t = (R(delta(t)) q) . key t: the query rotated by its distance to key t,
    qv[0] * cos + qv[1] * sin, from tab's row for that distance (clamped into the table: a
    masked lane's distance may fall outside it)."""
    vt = f"float32x{LANES}"

    def term(t: int, c: int) -> tirx.PrimExpr:
        row = T.max(T.min(delta(t), rows - 1), 0)
        rotated = qv.vload([0, c * LANES], vt) * tab.vload([row, 0, c * LANES], vt) \
            + qv.vload([1, c * LANES], vt) * tab.vload([row, 1, c * LANES], vt)
        return rotated * key(t, c)

    return sum_tile(term, d)


def _window_attention(d: int, rows: int, softcap: float):  # noqa: ANN202 - a TVMScript macro
    """schedules/cpu/attention.py `_window_page_attention` (pages of 16 keys) with rotated scores:
    slot s of a segment is at distance base - s from the query."""
    n_c = d // LANES
    cap = capper(softcap)
    load = _load_query(d)

    @T.macro
    def segment(qv, tab, pages, page_values, hk, first, s_lo, s_hi, base, scale, acc, s, st):
        for p in T.serial(s_lo // LANES, T.max((s_hi + LANES - 1) // LANES, s_lo // LANES)):
            page: T.let[T.int32] = page_values[first + p]
            st[2] = T.float32(_NEG)
            s[T.Ramp(0, 1, LANES)] = T.Select(
                T.Ramp(0, 1, LANES) < T.Broadcast(s_hi - p * LANES, LANES),
                T.Select(T.Ramp(0, 1, LANES) >= T.Broadcast(s_lo - p * LANES, LANES),
                         cap(_rotated_scores(qv, tab, lambda t, c: vload32(pages, [page, 0, hk, t, c * LANES]),
                                             lambda t: base - p * LANES - t, rows, d) * T.Broadcast(scale, LANES)),
                         T.Broadcast(T.float32(_NEG), LANES)),
                T.Broadcast(T.float32(_NEG), LANES))
            for t in T.serial(LANES):
                st[2] = T.max(st[2], s[t])
            if st[2] > st[0]:
                st[3] = T.exp2(st[0] - st[2])
                st[1] = st[1] * st[3]
                for i in T.vectorized(d):
                    acc[i] = acc[i] * st[3]
                st[0] = st[2]
            s[T.Ramp(0, 1, LANES)] = exp2_tile(s[T.Ramp(0, 1, LANES)] - T.Broadcast(st[0], LANES))
            for t in T.serial(LANES):
                if p * LANES + t >= s_lo and p * LANES + t < s_hi:  # masked slots never summed
                    st[1] = st[1] + s[t]
                    for c in T.unroll(n_c):
                        for j in T.vectorized(LANES):
                            acc[c * LANES + j] = acc[c * LANES + j] + s[t] * widen(pages[page, 1, hk, t, c * LANES + j])

    @T.macro
    def attend(q, tab, pages, page_values, output, lse, row, h, hk, first, lo0, hi0, base0, lo1, hi1, base1, scale):
        with T.sblock("attn"):
            acc = T.sblock_alloc_buffer((d,), "float32")
            qv = T.sblock_alloc_buffer((2, d), "float32")
            s = T.sblock_alloc_buffer((LANES,), "float32")
            st = T.sblock_alloc_buffer((4,), "float32")  # m, d, page max, scratch
            load(q, qv, row, h)
            for i in T.vectorized(d):
                acc[i] = T.float32(0)
            st[0] = T.float32(_NEG)
            st[1] = T.float32(0)
            segment(qv, tab, pages, page_values, hk, first, lo0, hi0, base0, scale, acc, s, st)
            segment(qv, tab, pages, page_values, hk, first, lo1, hi1, base1, scale, acc, s, st)
            for i in T.vectorized(d):
                output[row, h, i] = narrow(output, T.if_then_else(st[1] > T.float32(0), acc[i] / st[1],
                                                                  T.float32(0)))
            lse[row, h] = T.if_then_else(st[1] > T.float32(0), st[0] + T.log2(st[1]), T.float32(_NEG))

    return attend


def _ragged_kernel(h_kv: int, h_q: int, d: int, rows: int, softcap: float = 0.0,
                   dtype: str = "float32") -> tirx.PrimFunc:
    """schedules/cpu/attention.py's ragged prefill (a chunk attending to itself, causally) with
    the key at row j of sequence b at position k_rope_pos_offset[b] + j."""
    group = h_q // h_kv
    n_c = d // LANES
    cap = capper(softcap)
    fill = _rope_table(d, rows)
    load = _load_query(d)
    msg = f"the inline-rope ragged prefill reads distances below {rows} (2 x the window): a longer chunk"

    @T.prim_func(s_tir=True)
    def batch_prefill_ragged_kv(
        var_q: T.handle, var_q_indptr: T.handle, var_k: T.handle, var_v: T.handle, var_kv_indptr: T.handle,
        var_q_rope_position: T.handle, var_k_rope_pos_offset: T.handle, var_output: T.handle, var_lse: T.handle,
        causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        batch_size = T.int32()
        qo_len = T.int32()
        kv_len = T.int32()
        q_indptr_elem_offset = T.int32()
        kv_indptr_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q = T.match_buffer(var_q, (qo_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        k = T.match_buffer(var_k, (kv_len, h_kv, d), dtype)
        v = T.match_buffer(var_v, (kv_len, h_kv, d), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_indptr_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (qo_len,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        output = T.match_buffer(var_output, (qo_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (qo_len, h_q), "float32")

        T.Assert(rotary_mode == 1, "the window-freeing cache's CPU ragged prefill applies rope inline (rotary_mode 1)")
        T.Assert(causal > 0, "the window-freeing cache's CPU ragged prefill is causal")
        tab = T.alloc_buffer((rows, 2, d), "float32")
        hi = T.alloc_buffer((max((rows + STEP - 1) // STEP, 2), 2, d // 2), "float64")
        lo = T.alloc_buffer((STEP, 2, d // 2), "float64")
        inv = T.alloc_buffer((d // 2,), "float64")
        n_rows = T.alloc_buffer((1,), "int32")
        n_rows[0] = 1
        for b in T.serial(batch_size):
            for r in T.serial(q_indptr[b], q_indptr[b + 1]):
                n_rows[0] = T.max(n_rows[0], q_rope_position[r] - k_rope_pos_offset[b] + 1)
        T.Assert(n_rows[0] <= rows, msg)
        fill(tab, hi, lo, inv, n_rows[0], rope_theta, rope_scale)
        for b in T.serial(batch_size):
            for qh in T.parallel((q_indptr[b + 1] - q_indptr[b]) * h_q):
                n_q: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
                q_idx: T.let[T.int32] = _balanced(qh // h_q, n_q)
                h: T.let[T.int32] = qh % h_q
                hk: T.let[T.int32] = h // group
                q_row: T.let[T.int32] = q_indptr[b] + q_idx
                kv0: T.let[T.int32] = kv_indptr[b]
                n_kv: T.let[T.int32] = kv_indptr[b + 1] - kv_indptr[b]
                n_keys: T.let[T.int32] = T.min(n_kv - n_q + q_idx + 1, n_kv)
                base: T.let[T.int32] = q_rope_position[q_row] - k_rope_pos_offset[b]
                scale: T.let[T.float32] = sm_scale * T.float32(LOG2E)
                with T.sblock("attn"):
                    acc = T.sblock_alloc_buffer((d,), "float32")
                    qv = T.sblock_alloc_buffer((2, d), "float32")
                    s = T.sblock_alloc_buffer((TILE,), "float32")
                    st = T.sblock_alloc_buffer((4,), "float32")  # m, d, tile max, scratch
                    load(q, qv, q_row, h)
                    for i in T.vectorized(d):
                        acc[i] = T.float32(0)
                    st[0] = T.float32(_NEG)
                    st[1] = T.float32(0)
                    for kt in T.serial((n_keys + TILE - 1) // TILE):
                        st[2] = T.float32(_NEG)
                        # keys past n_keys masked, their rows clamped to the sequence's last key
                        s[T.Ramp(0, 1, LANES)] = T.Select(
                            T.Ramp(0, 1, LANES) < T.Broadcast(n_keys - kt * TILE, LANES),
                            cap(_rotated_scores(
                                qv, tab,
                                lambda t, c: vload32(k, [kv0 + T.min(kt * TILE + t, n_kv - 1), hk, c * LANES]),
                                lambda t: base - T.min(kt * TILE + t, n_kv - 1), rows, d)
                                * T.Broadcast(scale, LANES)),
                            T.Broadcast(T.float32(_NEG), LANES))
                        for t in T.serial(TILE):
                            st[2] = T.max(st[2], s[t])
                        if st[2] > st[0]:
                            st[3] = T.exp2(st[0] - st[2])
                            st[1] = st[1] * st[3]
                            for i in T.vectorized(d):
                                acc[i] = acc[i] * st[3]
                            st[0] = st[2]
                        s[T.Ramp(0, 1, LANES)] = exp2_tile(s[T.Ramp(0, 1, LANES)] - T.Broadcast(st[0], LANES))
                        for t in T.serial(TILE):
                            if kt * TILE + t < n_keys:
                                st[1] = st[1] + s[t]
                                for c in T.unroll(n_c):
                                    for j in T.vectorized(LANES):
                                        acc[c * LANES + j] = acc[c * LANES + j] \
                                            + s[t] * widen(v[kv0 + kt * TILE + t, hk, c * LANES + j])
                    for i in T.vectorized(d):
                        output[q_row, h, i] = narrow(output, T.if_then_else(st[1] > T.float32(0), acc[i] / st[1],
                                                                            T.float32(0)))
                    lse[q_row, h] = T.if_then_else(st[1] > T.float32(0), st[0] + T.log2(st[1]), T.float32(_NEG))

    return batch_prefill_ragged_kv


def _prefill_kernel(h_kv: int, h_q: int, d: int, window: int, rows: int, softcap: float = 0.0,
                    dtype: str = "float32") -> tirx.PrimFunc:
    """The sliding-window paged prefill over the cached keys, query i of a chunk seeing the last
    max(window - i - 1, 0) of them whatever `causal` says (models/window_cache.py `_masked_prefill`
    makes TVM's kernel so; with window - 1 kept keys every query sees exactly `window`)."""
    group = h_q // h_kv
    fill = _rope_table(d, rows)
    attend = _window_attention(d, rows, softcap)
    msg = f"the inline-rope paged prefill reads distances below {rows} (2 x the window): a longer chunk"

    @T.prim_func(s_tir=True)
    def batch_prefill_paged_kv_cpu_sliding_window(
        var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle, var_page_indptr: T.handle,
        var_page_values: T.handle, var_length_info: T.handle, var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle, var_output: T.handle, var_lse: T.handle,
        causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        batch_size = T.int32()
        total_len = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        q_indptr_elem_offset = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        q = T.match_buffer(var_q, (total_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_elem_offset)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, h_kv, LANES, d), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=page_values_elem_offset)
        length_info = T.match_buffer(var_length_info, (3, batch_size), "int32", elem_offset=length_info_elem_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(var_output, (total_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (total_len, h_q), "float32")

        T.Assert(rotary_mode == 1, "the window-freeing cache's CPU paged prefill applies rope inline (rotary_mode 1)")
        tab = T.alloc_buffer((rows, 2, d), "float32")
        hi = T.alloc_buffer((max((rows + STEP - 1) // STEP, 2), 2, d // 2), "float64")
        lo = T.alloc_buffer((STEP, 2, d // 2), "float64")
        inv = T.alloc_buffer((d // 2,), "float64")
        n_rows = T.alloc_buffer((1,), "int32")
        n_rows[0] = 1
        for b in T.serial(batch_size):
            for r in T.serial(q_indptr[b], q_indptr[b + 1]):
                n_rows[0] = T.max(n_rows[0], q_rope_position[r] - k_rope_pos_offset[b] + 1)
        T.Assert(n_rows[0] <= rows, msg)
        fill(tab, hi, lo, inv, n_rows[0], rope_theta, rope_scale)
        for b in T.serial(batch_size):
            for qh in T.parallel((q_indptr[b + 1] - q_indptr[b]) * h_q):
                q_idx: T.let[T.int32] = qh // h_q
                h: T.let[T.int32] = qh % h_q
                hk: T.let[T.int32] = h // group
                q_row: T.let[T.int32] = q_indptr[b] + q_idx
                first: T.let[T.int32] = page_indptr[b]
                n_pages: T.let[T.int32] = page_indptr[b + 1] - page_indptr[b]
                sink: T.let[T.int32] = length_info[2, b]
                offset: T.let[T.int32] = length_info[1, b]
                n_kv: T.let[T.int32] = T.if_then_else(
                    n_pages > 0, (n_pages - 1) * LANES + length_info[0, b] - offset + sink, 0)
                lo_key: T.let[T.int32] = T.max(n_kv - T.max(window - q_idx - 1, 0), 0)
                base: T.let[T.int32] = q_rope_position[q_row] - k_rope_pos_offset[b]
                scale: T.let[T.float32] = sm_scale * T.float32(LOG2E)
                # logical [lo_key, n_kv): the sink's slots, then the window's from `offset`
                attend(q, tab, pages, page_values, output, lse, q_row, h, hk, first,
                       T.min(lo_key, sink), T.min(n_kv, sink), base,
                       T.max(lo_key, sink) - sink + offset, T.max(n_kv, sink) - sink + offset,
                       base + offset - sink, scale)

    return batch_prefill_paged_kv_cpu_sliding_window


def _decode_kernel(h_kv: int, h_q: int, d: int, rows: int, softcap: float = 0.0,
                   dtype: str = "float32") -> tirx.PrimFunc:
    """The sliding-window paged decode: every cached key (the sink's, then the window's)."""
    group = h_q // h_kv
    fill = _rope_table(d, rows)
    attend = _window_attention(d, rows, softcap)
    msg = f"the inline-rope decode reads distances below {rows} (2 x the window): a longer sequence"

    @T.prim_func(s_tir=True)
    def batch_decode_paged_kv_cpu_sliding_window(
        q_handle: T.handle, pages_handle: T.handle, page_indptr_handle: T.handle, page_values_handle: T.handle,
        length_info_handle: T.handle, k_rope_pos_offset_handle: T.handle, q_rope_position_handle: T.handle,
        output_handle: T.handle, lse_handle: T.handle,
        rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        batch = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        q = T.match_buffer(q_handle, (batch, h_q, d), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, h_kv, LANES, d), dtype)
        page_indptr = T.match_buffer(page_indptr_handle, (batch + 1,), "int32", elem_offset=page_indptr_elem_offset)
        page_values = T.match_buffer(page_values_handle, (nnz_pages,), "int32", elem_offset=page_values_elem_offset)
        length_info = T.match_buffer(length_info_handle, (3, batch), "int32", elem_offset=length_info_elem_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (batch,), "int32",
                                           elem_offset=k_rope_pos_offset_elem_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (batch,), "int32",
                                         elem_offset=q_rope_position_elem_offset)
        output = T.match_buffer(output_handle, (batch, h_q, d), dtype)
        lse = T.match_buffer(lse_handle, (batch, h_q), "float32")

        T.Assert(rotary_mode == 1, "the window-freeing cache's CPU decode applies rope inline (rotary_mode 1)")
        tab = T.alloc_buffer((rows, 2, d), "float32")
        hi = T.alloc_buffer((max((rows + STEP - 1) // STEP, 2), 2, d // 2), "float64")
        lo = T.alloc_buffer((STEP, 2, d // 2), "float64")
        inv = T.alloc_buffer((d // 2,), "float64")
        n_rows = T.alloc_buffer((1,), "int32")
        n_rows[0] = 1
        for b in T.serial(batch):
            n_rows[0] = T.max(n_rows[0], q_rope_position[b] - k_rope_pos_offset[b] + 1)
        T.Assert(n_rows[0] <= rows, msg)
        fill(tab, hi, lo, inv, n_rows[0], rope_theta, rope_scale)
        for bh in T.parallel(batch * h_q):
            b: T.let[T.int32] = bh // h_q
            h: T.let[T.int32] = bh % h_q
            hk: T.let[T.int32] = h // group
            first: T.let[T.int32] = page_indptr[b]
            n_pages: T.let[T.int32] = page_indptr[b + 1] - page_indptr[b]
            sink: T.let[T.int32] = length_info[2, b]
            offset: T.let[T.int32] = length_info[1, b]
            n_kv: T.let[T.int32] = T.if_then_else(
                n_pages > 0, (n_pages - 1) * LANES + length_info[0, b] - offset + sink, 0)
            base: T.let[T.int32] = q_rope_position[b] - k_rope_pos_offset[b]
            scale: T.let[T.float32] = sm_scale * T.float32(LOG2E)
            attend(q, tab, pages, page_values, output, lse, b, h, hk, first, 0, T.min(n_kv, sink), base,
                   offset, T.max(n_kv, sink) - sink + offset, base + offset - sink, scale)

    return batch_decode_paged_kv_cpu_sliding_window


__all__ = ["FREEING_SUFFIX", "freeing_window", "rewrite_inline_rope", "window_freeing_kernels"]
