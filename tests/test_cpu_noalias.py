"""schedules/cpu/noalias.py: every kernel of a CPU build declared noalias.

TVM's LLVM codegen marks buffers as possibly aliased ("tvm-alias" TBAA) in functions without
`tirx.noalias`, and a model library always holds some (TVM's KV-cache kernels, Relax's shape
functions); beside them the matmul micro-kernel's sums came out stored to memory after every
multiply-add (seen in whole libraries; in small modules only sometimes). Checked in the LLVM IR
of a tiny decoder built through vtool's pipeline: no buffer left possibly aliased, and the
micro-kernel's inner loops hold their sums in registers (no vector store in their block)."""
from __future__ import annotations

import json
import re

import pytest

tvm = pytest.importorskip("tvm")
from tvm import relax, te  # noqa: E402

from vtool.schedules.cpu.matmul import TILES, TILES_AVX512  # noqa: E402
from vtool.schedules.cpu.noalias import NOALIAS, PASS_NAME, declare_noalias, declare_noalias_pass  # noqa: E402


def _copy(noalias: bool | None) -> tvm.tirx.PrimFunc:
    x = te.placeholder((16,), "float32", name="x")
    y = te.compute((16,), lambda i: x[i], name="y")
    func = te.create_prim_func([x, y]).with_attr("global_symbol", "copy")
    return func.without_attr(NOALIAS) if noalias is None else func.with_attr(NOALIAS, noalias)


@pytest.mark.parametrize("noalias", [None, False])
def test_the_pass_declares_every_primfunc_and_leaves_relax_functions(noalias):
    mod = tvm.IRModule({"copy": _copy(noalias), "main": relax.Function([], relax.Tuple([]))})
    out = declare_noalias_pass()(mod)
    assert bool(out["copy"].attrs[NOALIAS])
    assert isinstance(out["main"], relax.Function)
    assert declare_noalias(out["copy"]) is None  # already declared: nothing to do


def _inner_loops(ll: str) -> list[tuple[str, int]]:
    """(label, vector stores) of each micro-kernel inner loop: a basic block that loops on itself
    over the reduction's inner split (TVM names it for_body_k_1...) with one tile's worth of
    vector multiply-adds (rows x vectors of a micro-kernel tile)."""
    tiles = {t.rows * t.vectors for t in TILES + TILES_AVX512}
    out = []
    for fn in re.split(r"\ndefine ", ll)[1:]:
        for block in fn.split("\n\n"):
            label = block.split(":", 1)[0].strip()
            fmas = len(re.findall(r"llvm\.fmuladd\.v(?:8|16)f32", block))
            loops = re.search(rf"br .*label %{re.escape(label)}\b", block) is not None
            if label.startswith("for_body_k_") and loops and fmas in tiles:
                out.append((label, len(re.findall(r"store <(?:8|16) x float>", block))))
    return out


@pytest.fixture(scope="module")
def decoder_ir(tmp_path_factory):
    """The LLVM IR of a tiny float32 decoder built for x86-avx512 (compiled, not run: any x86
    host), captured from tvm.compile, and the artifact's manifest."""
    from tiny_models import make_tiny_model

    from vtool.toolchain.build import build_artifact

    folder = make_tiny_model("llama-k256", tmp_path_factory.mktemp("k256"))  # 256-wide: the micro-kernel fits
    seen: list[str] = []
    compile_ = tvm.compile

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003
        executable = compile_(*args, **kwargs)
        modules = [executable.mod]
        while modules:
            m = modules.pop()
            if m.kind == "llvm":
                seen.append(m.inspect_source("ll"))
            modules += list(m.imports)
        return executable

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tvm, "compile", spy)
        mp.setenv("VTOOL_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        art = build_artifact(folder, "x86-avx512", output=tmp_path_factory.mktemp("art") / "a", force=True)
    assert len(seen) == 1
    return seen[0], json.loads((art / "manifest.json").read_text())


def test_a_decoder_library_leaves_no_buffer_possibly_aliased(decoder_ir):
    ll, manifest = decoder_ir
    assert '!"tvm-alias"' not in ll
    assert PASS_NAME in manifest["build"]["pipeline"]["passes"]  # the manifest says the build had it


def test_the_micro_kernel_keeps_its_sums_in_registers_inside_a_library(decoder_ir):
    loops = _inner_loops(decoder_ir[0])
    assert loops, "no micro-kernel inner loop found (the tiny model's matmuls should take it)"
    assert all(stores == 0 for _label, stores in loops), loops

