"""Which weights an `--quantization fp8` build keeps in FP8, and which matmuls take W8A8.

A float checkpoint: every decoder linear whose columns fit, quantized when the artifact loads
(runtime/weights/fp8.py). An FP8 checkpoint (compressed-tensors, ModelOpt, vLLM's fp8): exactly
the linears it stores as e4m3, bound as they are; the plan refuses what it cannot take (an e4m3
tensor elsewhere, block-wise scales). On CUDA targets with e4m3 tensor cores and cuBLAS matmuls,
prompts and batched decode quantize their activations per token (models/fp8_linear.py).
"""
from __future__ import annotations

from vtool import VtoolError
from vtool.models.config import ModelConfig
from vtool.models.weights import FLOAT_TYPES, weight_modules
from vtool.runtime.weights.checkpoint import Checkpoint
from vtool.runtime.weights.fp8 import STORED_FP8, check_stored_scale
from vtool.runtime.weights.fp8_layout import FP8_FORMAT, fits
from vtool.targets import TargetSpec

FP8_TENSOR_CORES = "fp8-e4m3"  # the target feature (targets/table.py) of e4m3 tensor-core GEMMs
FP8_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # models/decoder.py's make_linear layers
FP8_REFUSED_FAMILIES = ("qwen3_moe", "mixtral", "gpt2")  # their projections are not make_linear's


def stored_fp8_tensors(ckpt: Checkpoint) -> list[str]:
    """The tensors `ckpt` stores as e4m3 (an FP8 checkpoint's weights), sorted; [] for others."""
    return sorted(n for n, t in ckpt.tensors().items() if t.dtype == STORED_FP8)


def fp8_formats(ckpt: Checkpoint, cfg: ModelConfig) -> dict[str, str]:
    """module -> FP8_FORMAT for --quantization fp8. A float checkpoint: every decoder linear
    (q|k|v, o, gate|up, down) whose weights fit, quantized when it loads; the embedding and
    lm_head keep the dtype, as in vLLM. An FP8 checkpoint (compressed-tensors, ModelOpt, vLLM's
    fp8): the linears it stores as e4m3, taken as they are; those it left float stay float."""
    from vtool.models.registry import model_family

    if ckpt.format == "gguf":
        raise VtoolError(f"--quantization fp8 quantizes a float (safetensors) checkpoint, but {ckpt.path} is a GGUF "
                         "file: use --quantization gguf (or auto) to keep its blocks, or none")
    if model_family(cfg.architecture).task != "generate" or cfg.family in FP8_REFUSED_FAMILIES:
        raise VtoolError(f"--quantization fp8: the {cfg.family} family ({cfg.architecture}) has no FP8 layers yet; "
                         "use --quantization none")
    infos = ckpt.tensors()
    stored = set(stored_fp8_tensors(ckpt))
    kept = {}
    for module, sources in weight_modules(cfg).items():
        linear = module.rsplit(".", 1)[-1] in FP8_LAYERS
        fp8_sources = [s for s in sources if s in stored]
        if fp8_sources and (not linear or len(fp8_sources) != len(sources)):
            raise VtoolError(f"{ckpt.path}: {fp8_sources[0]!r} is stored as FP8, but vtool keeps FP8 weights only in "
                             f"decoder linears ({', '.join(FP8_LAYERS)}) whose parts are all FP8: {module} is made of "
                             f"{[f'{s} ({infos[s].dtype})' for s in sources]}")
        if not linear or (stored and not fp8_sources):
            continue  # an FP8 checkpoint's float linears stay float, as its quantization config left them
        if all((infos[s].dtype == STORED_FP8 or infos[s].dtype in FLOAT_TYPES) and fits(*infos[s].shape)
               for s in sources):
            kept[module] = FP8_FORMAT
    for name in sorted(stored):
        check_stored_scale(ckpt, name)  # per tensor or per row, by its header
    covered = {s for module in kept for s in weight_modules(cfg)[module]}
    if stored - covered:
        raise VtoolError(f"{ckpt.path}: {sorted(stored - covered)[0]!r} is stored as FP8 but is not a decoder linear "
                         f"vtool keeps in FP8 ({', '.join(FP8_LAYERS)}, columns a multiple of 16)")
    if not kept:
        raise VtoolError(f"--quantization fp8: no linear weight of {ckpt.path} is a float tensor whose columns are a "
                         "multiple of 16; use --quantization none")
    return kept


def fp8_tensor_cores(target_spec: TargetSpec, gemm: str) -> bool:
    """Whether an FP8 build for this target runs W8A8 matmuls: cuBLAS(Lt) matmuls and a GPU with
    e4m3 tensor cores (sm_89 and newer; a fat binary's oldest arch decides)."""
    return gemm == "cublas" and FP8_TENSOR_CORES in target_spec.features

