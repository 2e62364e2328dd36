"""Why a verify step costs more than a decode step on a GPU: the model step alone, per entry
point (decode of one token; batch_verify, its captured copy and batch_prefill of 1 + k tokens),
with the GPU's own kernel times from torch.profiler (CUPTI sees every kernel in the process,
TVM's included), and the numerics: the logits batch_verify gives for a token against the ones
decode gives for it at the same position (max difference, same argmax).

    python tests/bench/verify_profile.py --artifact ART --model CKPT [--k 4] [--context 128]

Needs torch with CUDA (for the profiler only); prints one JSON line and the kernel tables.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from vtool.runtime.artifact.tvm_runtime import global_func
from vtool.runtime.engine.kv_cache import PagedKVCache
from vtool.runtime.session import open_session
from vtool.runtime.weights.checkpoint import open_checkpoint


class Stepper:
    """One sequence in its own KV cache, with the entry points called by hand."""

    def __init__(self, model, context: int):
        self.m, self.view = model, global_func("runtime.TVMTensorCreateView")
        self.kv = PagedKVCache(model, 128, 16, 4, 2048)
        self.seq = 1
        self.kv.add(self.seq)
        ids = np.arange(1000, 1000 + context, dtype=np.int32)
        self.logits("prefill", ids)

    def logits(self, entry: str, ids: np.ndarray, keep: bool = True):
        m, n = self.m, len(ids)
        emb = m.function("embed")(m.upload(ids.astype(np.int32)), m.params)
        self.kv.begin_forward([self.seq], [n])
        x = self.view(emb, m.ffi.Shape([1, n, m.hidden_size]), m.dtype, 0)
        if entry in ("decode", "prefill"):
            out, _ = m.function(entry)(x, self.kv.tvm, m.params)
        else:
            out, _ = m.function(entry)(x, m.upload(np.arange(n, dtype=np.int32)), self.kv.tvm, m.params)
        self.kv.end_forward()
        if not keep:
            self.kv.pop(self.seq, n)
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    session = open_session(a.artifact, open_checkpoint(a.model), max_model_len=2048)
    m = session.model
    s = Stepper(m, a.context)
    n = 1 + a.k
    ids = np.arange(2000, 2000 + n, dtype=np.int32)
    entries = [("decode", ids[:1])] + [(e, ids) for e in ("batch_verify", "batch_verify_captured", "batch_prefill")
                                       if m.has_function(e)]
    # numerics: row 0 of a verify against decode of the same token at the same position
    dec = m.to_numpy(s.logits("decode", ids[:1], keep=False)).reshape(-1)
    report: dict = {"bench": "verify_profile", "k": a.k, "context": a.context}
    for e, x in entries[1:]:
        row = m.to_numpy(s.logits(e, x, keep=False)).reshape(n, -1)[0]
        top2 = np.sort(dec)[-2:]
        report[f"{e}_vs_decode"] = {"max_abs": float(np.abs(row - dec).max()), "same_argmax": int(row.argmax()) == int(dec.argmax()),
                                    "decode_top2_gap": float(top2[1] - top2[0]), "logit_std": float(dec.std())}
    for e, x in entries:  # host wall per call, waited for
        for _ in range(3):
            m.to_numpy(s.logits(e, x, keep=False))
        t = time.perf_counter()
        for _ in range(a.reps):
            out = s.logits(e, x, keep=False)
        m.to_numpy(out)
        report[f"{e}_ms"] = (time.perf_counter() - t) / a.reps * 1e3
    print(json.dumps(report))
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    for e, x in entries:
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(a.reps):
                out = s.logits(e, x, keep=False)
            m.to_numpy(out)
        events = [ev for ev in prof.key_averages() if ev.device_type.name == "CUDA" or getattr(ev, "self_device_time_total", 0)]
        total = sum(getattr(ev, "self_device_time_total", 0) for ev in prof.key_averages()) / a.reps / 1e3
        print(f"== {e} ({len(x)} tokens): GPU kernel time {total:.3f} ms per call; top kernels (ms per call, calls per call)")
        rows = sorted(prof.key_averages(), key=lambda ev: -getattr(ev, "self_device_time_total", 0))[:12]
        for ev in rows:
            t = getattr(ev, "self_device_time_total", 0) / a.reps / 1e3
            if t > 0:
                print(f"   {t:8.4f}  {ev.count / a.reps:6.1f}  {ev.key[:110]}")


if __name__ == "__main__":
    main()
