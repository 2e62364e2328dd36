"""Attention logit soft-capping in the CPU attention kernels, kernel by kernel: TVM's serial
paged decode, paged prefill and ragged prefill with models/softcap.py's rewrite, and vtool's
parallel kernels that replace them (schedules/cpu/attention.py, which read the cap from the
kernel replaced), held to a float64 numpy softmax over scores cap * tanh(q.k * scale / cap)
(transformers' Gemma-2 eager attention), masked causally after the cap. The scores reach well
past the cap: every test also checks that the uncapped attention is far from what the kernel
gives. Whole models: tests/test_gemma.py."""
from __future__ import annotations

import functools

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from vtool.models.softcap import softcap_kernel  # noqa: E402
from vtool.schedules.cpu.attention import (DECODE_NAME, NAME, PAGED_PREFILL_NAME, rewrite_decode_paged,  # noqa: E402
                                          rewrite_prefill_paged, rewrite_prefill_ragged)
from vtool.targets import buildable  # noqa: E402

TARGET = tvm.target.Target(buildable("host").tvm)
H_KV, H_Q, D, PAGE = 2, 4, 32, 16
SCALE, CAP = 0.25, 1.5


@functools.cache
def _kernels(kind: str) -> dict[str, object]:
    """{"tvm": TVM's kernel capped, "vtool": vtool's in its place}, compiled."""
    from tvm.relax.frontend.nn.llm import kv_cache as K

    made = {"decode": (K._attention_decode_cpu(H_KV, H_Q, D, "float32", False, {}), DECODE_NAME, rewrite_decode_paged),
            "prefill": (K._attention_prefill_cpu(H_KV, H_Q, D, "float32", False, {}), PAGED_PREFILL_NAME,
                        rewrite_prefill_paged),
            "ragged": (K._attention_prefill_ragged_cpu(H_KV, H_Q, D, D, "float32", {}), NAME, rewrite_prefill_ragged)}
    func, name, rule = made[kind]
    capped = softcap_kernel(func.with_attr("global_symbol", name), CAP)
    ours = rule(name, capped)
    assert ours is not None and "T.tanh(" in ours.script()
    return {who: tvm.compile(tvm.IRModule({"main": f}), target=TARGET)["main"]
            for who, f in (("tvm", capped), ("vtool", ours))}


def _reference(q: np.ndarray, keys: list[np.ndarray], vals: list[np.ndarray], visible: list[int],
               cap: float | None = CAP):
    """Row r of q against the first visible[r] of keys[r] / vals[r] ([n, H_KV, D] each); cap None: uncapped."""
    out = np.zeros(q.shape, np.float64)
    lse = np.zeros(q.shape[:2], np.float64)
    for r in range(q.shape[0]):
        for h in range(H_Q):
            k = keys[r][:visible[r], h // (H_Q // H_KV)].astype(np.float64)
            v = vals[r][:visible[r], h // (H_Q // H_KV)].astype(np.float64)
            s = k @ q[r, h].astype(np.float64) * SCALE
            s = (s if cap is None else cap * np.tanh(s / cap)) * np.log2(np.e)  # log2 units, as the kernels
            p = np.exp2(s - s.max())
            out[r, h], lse[r, h] = p @ v / p.sum(), s.max() + np.log2(p.sum())
    return out, lse


def _paged(rng, kv_lens: list[int]):
    n_pages = [(n + PAGE - 1) // PAGE for n in kv_lens]
    order = rng.permutation(sum(n_pages) + 2).astype("int32")[:sum(n_pages)]  # shuffled, some pages unused
    pages = (rng.standard_normal((sum(n_pages) + 2, 2, H_KV, PAGE, D)) * 2).astype("float32")
    indptr = np.cumsum([0] + n_pages).astype("int32")
    last = np.array([n - (p - 1) * PAGE for n, p in zip(kv_lens, n_pages)], "int32")
    kv = [pages[order[indptr[b]:indptr[b + 1]]].transpose(1, 0, 3, 2, 4).reshape(2, -1, H_KV, D)[:, :n]
          for b, n in enumerate(kv_lens)]
    return pages, indptr, order, last, kv


def _run(func, inputs: list[np.ndarray], rows: int, scalars: tuple) -> tuple[np.ndarray, np.ndarray]:
    out = tvm.runtime.tensor(np.full((rows, H_Q, D), np.nan, "float32"))
    lse = tvm.runtime.tensor(np.full((rows, H_Q), np.nan, "float32"))
    func(*[tvm.runtime.tensor(a) for a in inputs], out, lse, *scalars)
    return out.numpy(), lse.numpy()


def _assert_close(got: tuple, want: tuple, uncapped: tuple) -> None:
    np.testing.assert_allclose(got[0], want[0], atol=3e-5, rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], atol=3e-5, rtol=1e-5)
    assert np.abs(got[0] - uncapped[0]).max() > 0.1  # the cap bites: an uncapped kernel fails by far


@pytest.mark.parametrize("who", ["tvm", "vtool"])
def test_paged_decode(who):
    rng = np.random.default_rng(0)
    kv_lens = [37, 1, 16, 70]
    pages, indptr, order, last, kv = _paged(rng, kv_lens)
    q = (rng.standard_normal((len(kv_lens), H_Q, D)) * 2).astype("float32")
    args = (q, [k for k, _ in kv], [v for _, v in kv], kv_lens)
    zeros = np.zeros(len(kv_lens), "int32")
    got = _run(_kernels("decode")[who], [q, pages, indptr, order, last, zeros, zeros], len(kv_lens),
               (0, 1.0, 10000.0, SCALE))
    _assert_close(got, _reference(*args), _reference(*args, cap=None))


@pytest.mark.parametrize("who", ["tvm", "vtool"])
@pytest.mark.parametrize("causal", [1, 0])
def test_paged_prefill(who, causal):
    """A chunk of queries over cached keys: causal query i of n sees kv_len - n + i + 1 of them,
    the mask applied to capped scores."""
    rng = np.random.default_rng(1 + causal)
    q_lens, kv_lens = [5, 3], [40, 19]
    pages, indptr, order, last, kv = _paged(rng, kv_lens)
    q = (rng.standard_normal((sum(q_lens), H_Q, D)) * 2).astype("float32")
    keys, vals, visible = [], [], []
    for b, (n_q, n_kv) in enumerate(zip(q_lens, kv_lens)):
        for i in range(n_q):
            keys.append(kv[b][0]), vals.append(kv[b][1])
            visible.append(n_kv - n_q + i + 1 if causal else n_kv)
    inputs = [q, np.cumsum([0] + q_lens).astype("int32"), pages, indptr, order, last,
              np.zeros(len(q_lens), "int32"), np.zeros(sum(q_lens), "int32")]
    _assert_close(_run(_kernels("prefill")[who], inputs, sum(q_lens), (causal, 0, 1.0, 10000.0, SCALE)),
                  _reference(q, keys, vals, visible), _reference(q, keys, vals, visible, cap=None))


@pytest.mark.parametrize("who", ["tvm", "vtool"])
def test_ragged_prefill(who):
    """A prompt's queries over its own keys, causal: query i sees keys 0..i."""
    rng = np.random.default_rng(3)
    lens = [9, 21]
    k = (rng.standard_normal((sum(lens), H_KV, D)) * 2).astype("float32")
    v = rng.standard_normal((sum(lens), H_KV, D)).astype("float32")
    q = (rng.standard_normal((sum(lens), H_Q, D)) * 2).astype("float32")
    indptr = np.cumsum([0] + lens).astype("int32")
    keys = [k[indptr[b]:indptr[b + 1]] for b, n in enumerate(lens) for _ in range(n)]
    vals = [v[indptr[b]:indptr[b + 1]] for b, n in enumerate(lens) for _ in range(n)]
    visible = [i + 1 for n in lens for i in range(n)]
    inputs = [q, indptr, k, v, indptr, np.zeros(sum(lens), "int32"), np.zeros(len(lens), "int32")]
    _assert_close(_run(_kernels("ragged")[who], inputs, sum(lens), (1, 0, 1.0, 10000.0, SCALE)),
                  _reference(q, keys, vals, visible), _reference(q, keys, vals, visible, cap=None))
