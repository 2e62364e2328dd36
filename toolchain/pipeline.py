"""vtool's Relax pipeline per target family (what differs per family is its entry in
toolchain/families.py: model passes, Relax backend, schedule rules, PassContext).

TVM's "default" pipeline legalizes `x @ W.T` into a transpose of every weight on every
call plus a matmul. FuseTransposeMatmul turns that into one NT_matmul kernel: decode on
CPU ran 14x faster (measured in the TVM notes), and on an H200 10x faster (the GPU
baseline). After legalization, the target's schedule rules from vtool.schedules run on
the TIR kernels.

CUDA: FuseTransposeMatmul, then TVM's CUDA backend pieces (library dispatch,
legalize + fuse, our schedules in place of the stock DLight list, dataflow lowering,
finalize). `pass_config` turns on CUDA graphs (relax.backend.use_cuda_graph), which
RewriteCUDAGraph in the finalize passes reads. It captures only the static regions of a
function: the kernel runs between KV-cache calls in `prefill`/`decode`, whose shapes are
fixed. In the symbolic-shape functions (batch_prefill, batch_decode) nothing is static,
so they stay uncaptured and unchanged.

Batched decode in CUDA graphs (`--cuda-graph-sizes`): after the schedules, `batch_decode`
is copied into `batch_decode_captured` (the same kernels, not one more to compile) with two
function attributes RewriteCUDAGraph and StaticPlanBlockMemory read in TVM 0.27:
`relax.rewrite_cuda_graph.capture_symbolic_vars = ["batch_size"]` lets a kernel run whose
shapes hold only `batch_size` be captured, and the lifted region gets `batch_size` as a
shape argument that vm.builtin.cuda_graph.run_or_capture also takes as its cache key (one
graph per distinct batch size, captured on first use); `tir_var_upper_bound = {"batch_size":
largest size}` makes the planner give its intermediates constant-size storage, which is
what lets them be static. MLC-LLM captures its batch_decode the same way. `batch_decode`
itself stays as it was: eager, for any batch size. The KV-cache calls (attention, its
aux-data copies, kernels whose grids follow the batch) stay outside the graphs, between them.

Speculative verification the same way: `batch_verify` is copied into `batch_verify_captured`,
captured per (token count, logit-position count), both at most the largest size. Unlike decode
it is not padded: the runtime calls it only with logits wanted at every position, so there is
one graph per token count (at most the largest size of them), each captured on first use.
"""
from __future__ import annotations

from typing import Any

import tvm
from tvm import relax

from vtool.schedules.cpu.noalias import declare_noalias_pass
from vtool.toolchain.families import CAPTURE_PASS, CAPTURED_BATCH_DECODE, CAPTURED_BATCH_VERIFY, family_named
from vtool.toolchain.reshape_chains import collapse_reshape_chains

# The symbolic batch dimension of batch_decode (models/decoder.py's spec names it).
BATCH_VAR = "batch_size"


def pass_config(family: str) -> dict[str, Any]:
    """The PassContext config tvm.compile runs under for this family (toolchain/families.py)."""
    return dict(family_named(family).pass_config)


def pass_context(family: str, dtype: str | None = None) -> Any:
    """The PassContext a build of this family and dtype compiles under (CPU builds: the ambient
    one, bfloat16's config added). `vtool tune` extracts kernels under it too: passes and
    configs that differ would give kernels whose hashes no build looks up."""
    return family_named(family).pass_context(dtype)


def describe(family: str, gemm: str = "tir", graph_sizes: tuple[int, ...] = ()) -> dict[str, Any]:
    """The manifest's record of the pipeline a library was built with."""
    entry = family_named(family)
    return entry.describe_pipeline(entry, gemm, tuple(graph_sizes))


# What the capture pass copies: source entry point -> (captured copy, its symbolic dims, each
# bounded by the largest graph size). batch_verify (speculative verification: every position's
# logits) is keyed by its token count and position count; the runtime only asks for it with
# logits at every position, so one graph per token count.
CAPTURED_COPIES = {
    "batch_decode": (CAPTURED_BATCH_DECODE, (BATCH_VAR,)),
    "batch_verify": (CAPTURED_BATCH_VERIFY, ("seq_len", BATCH_VAR)),
}


def graph_entry_points(graph_sizes: tuple[int, ...], entry_points: list[str]) -> list[str]:
    """The entry points the capture pass adds to a model with these (the manifest lists them)."""
    if not graph_sizes:
        return []
    return [copy for source, (copy, _dims) in CAPTURED_COPIES.items() if source in entry_points]


def capture_batch_decode_pass(graph_sizes: tuple[int, ...]) -> tvm.transform.Pass:
    """Add `batch_decode_captured` (and `batch_verify_captured`): copies that RewriteCUDAGraph
    captures once per value of their symbolic dims, each dim at most max(graph_sizes) (the
    module docstring says how). Run after the schedules, a copy calls the very kernels its
    source does."""
    bound = max(graph_sizes)

    @tvm.transform.module_pass(opt_level=0, name=CAPTURE_PASS)
    def _capture(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        names = {gv.name_hint for gv in mod.get_global_vars()}
        out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs, global_infos=mod.global_infos)
        for source_name, (copy_name, dims) in CAPTURED_COPIES.items():
            if source_name not in names:
                continue
            source = mod[source_name]
            defined = [v.name for v in relax.analysis.defined_symbolic_vars(source)]
            missing = [d for d in dims if d not in defined]
            if missing:
                raise RuntimeError(f"{source_name} has no symbolic {missing} to capture per value (has {defined})")
            # A copy with fresh variables: one function's Relax and TIR variables may not be another's.
            out[copy_name] = relax.utils.copy_with_new_vars(source).with_attrs({
                "global_symbol": copy_name,
                "tir_var_upper_bound": {d: bound for d in dims},
                "relax.rewrite_cuda_graph.capture_symbolic_vars": list(dims),
            })
        return out

    return _capture


def kernel_passes() -> list[tvm.transform.Pass]:
    """Legalize + fuse: after these the module holds the fused TIR kernels the schedule
    pass sees (`vtool tune` extracts them with the same passes, so hashes match)."""
    return [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
            relax.transform.FoldConstant(), relax.transform.FuseOps(), relax.transform.FuseTIR()]


def build_pipeline(target: tvm.target.Target, family: str, gemm: str = "tir",
                   records: Any = None, until_schedules: bool = False,
                   graph_sizes: tuple[int, ...] = ()) -> tvm.transform.Pass:
    """The family's model passes, (with gemm="cublas", the prefill/batched matmuls to
    cuBLAS,) FuseTransposeMatmul, the family's Relax backend's library dispatch, legalize +
    fuse, the family's schedule rules (tuning records first when `records`, a
    vtool.toolchain.records.RecordSet, is given), (with graph_sizes, the plan's resolved
    --cuda-graph-sizes: batch_decode_captured,) the backend's dataflow lowering and
    finalize passes. until_schedules: stop before the schedule pass (`vtool tune` extracts
    the kernels there)."""
    entry = family_named(family)
    backend = entry.backend()
    schedule_pass = entry.rules(records)
    capture = [capture_batch_decode_pass(tuple(graph_sizes))] if graph_sizes else []
    # CPU: every kernel noalias, last (the finalize passes add the shape functions), or LLVM
    # keeps no kernel's sums in registers (schedules/cpu/noalias.py)
    late = [declare_noalias_pass()] if entry.device == "cpu" else []
    # the family's own Relax passes (CUDA: the split-KV decode attention), then the cuBLAS offload
    offload: list[tvm.transform.Pass] = [make() for _name, make in entry.model_passes]
    if gemm == "cublas":
        from vtool.toolchain.gemm_offload import offload_pass

        offload.append(offload_pass())

    @tvm.transform.module_pass(opt_level=0, name=f"Vtool{family.upper()}Pipeline")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with target:
            passes = (
                offload
                # First of the rest, or every x @ W.T transposes its weight per call.
                + [relax.transform.FuseTransposeMatmul()]
                # Before legalization: a chain of reshapes becomes one, which becomes a view.
                + [collapse_reshape_chains()]
                + backend.library_dispatch_passes(target)
                # The CPU backend's legalize_passes, and the CUDA one's without its trailing
                # DLight pass: vtool's schedules take that place on both.
                + kernel_passes()
            )
            if not until_schedules:
                passes += ([schedule_pass] + capture + backend.dataflow_lower_passes(target)
                           + backend.finalize_passes(target) + late)
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline
