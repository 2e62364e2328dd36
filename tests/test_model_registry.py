"""models/registry.py: every registered architecture builds its module and plans its weights;
an unknown one is refused by name; every family's GGUF files are readable into what its weight
plan needs, checked against gguf-py's own tables (gguf.constants, gguf.tensor_mapping) and a
GGUF file written by gguf-py's writer, so the names are held to something nobody here wrote.
Also the two hand-offs that replaced imports: the int8 kernels the toolchain gives a model,
and the GPU sampler's function names the runtime calls.
"""
from __future__ import annotations

import ast
from pathlib import Path

import gguf
import numpy as np
import pytest

from vtool.models.config import ConfigError, parse_hf_config
from vtool.models.registry import ARCHITECTURES, FAMILIES, model_family
from vtool.models.weights import check_checkpoint_shapes, expected_source_shapes, weight_modules
from vtool.runtime.weights import gguf_reader
from vtool.runtime.weights.checkpoint import open_checkpoint

LAYERS = 2
PACKAGE = Path(__file__).resolve().parent.parent


def tiny_config(arch: str) -> dict:
    return {"architectures": [arch], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": LAYERS, "num_attention_heads": 4,
            "num_key_value_heads": 4 if arch == "GPT2LMHeadModel" else 2,  # GPT-2: no GQA
            "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128,
            "tie_word_embeddings": arch == "Gemma2ForCausalLM",  # llama.cpp's gemma2 has no output tensor
            **({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}  # mixtures of experts
               if arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM") else {})}


def _export(arch: str, formats: dict[str, str] | None = None, **int8):  # noqa: ANN202 - (module, its family, config)
    tvm = pytest.importorskip("tvm")
    cfg = parse_hf_config(tiny_config(arch))
    family = model_family(arch)
    model = family.module(cfg, "float32", tvm.target.Target("llvm"), formats, **int8)
    mod, named_params = model.export_tvm(spec=model.get_default_spec())
    return mod, family.weights.parameters(named_params, formats), cfg


# --- the registry ------------------------------------------------------------------------------

def test_families_claim_distinct_architectures():
    claimed = [arch for family in FAMILIES for arch in family.architectures]
    assert len(claimed) == len(set(claimed)) == len(ARCHITECTURES)
    assert len({family.name for family in FAMILIES}) == len(FAMILIES)


@pytest.mark.parametrize("arch", [arch for arch, f in ARCHITECTURES.items() if f.task == "generate"])
def test_every_architecture_builds_its_module_and_plans_its_weights(arch):
    # (embedding families, task "embed", export `encode` instead: tests/test_embeddings.py)
    mod, plan, cfg = _export(arch)
    assert cfg.family == model_family(arch).name
    assert {"embed", "prefill", "decode", "batch_prefill", "batch_decode",
            "create_tir_paged_kv_cache"} <= {gv.name_hint for gv in mod.functions}
    needed = expected_source_shapes(cfg)
    used: set[str] = set()
    for entry in plan:
        assert set(entry["sources"]) <= set(needed), entry
        used.update(entry["sources"])
        shapes = [needed[s] for s in entry["sources"]]
        if entry["transform"] in ("identity", "plus_one"):  # plus_one: Gemma's norm weights, 1 + w
            assert shapes == [tuple(entry["shape"])], entry
        elif entry["transform"] == "transpose":  # GPT-2's Conv1D [in, out]
            assert shapes == [tuple(reversed(entry["shape"]))], entry
        elif entry["transform"] == "stack_experts":  # MoE: one [rows, cols] per expert -> [E, rows, cols]
            assert shapes == [tuple(entry["shape"][1:])] * entry["shape"][0], entry
        elif entry["transform"] == "stack_gate_up_experts":  # MoE: E gates then E ups -> [E, 2I, H]
            e, rows, cols = entry["shape"]
            assert shapes == [(rows // 2, cols)] * (2 * e), entry
        else:  # concat_rows: the sources stacked along the output rows
            assert entry["transform"] == "concat_rows"
            assert sum(s[0] for s in shapes) == entry["shape"][0] and {s[1:] for s in shapes} == {
                tuple(entry["shape"][1:])}, entry
    assert used == set(needed)  # every tensor the config needs is bound, and nothing else


def test_the_families_flags():
    assert not parse_hf_config(tiny_config("LlamaForCausalLM")).attention_bias
    assert parse_hf_config(tiny_config("Qwen2ForCausalLM")).attention_bias
    assert parse_hf_config(tiny_config("Qwen3ForCausalLM")).qk_norm
    mistral = parse_hf_config(tiny_config("MistralForCausalLM") | {"sliding_window": 64})
    # a real window on every layer (models/llama.py), no longer a cap on the context
    assert mistral.max_position_embeddings > 64 and mistral.sliding_window == 64
    assert mistral.sliding_layers == tuple(range(mistral.num_hidden_layers))
    unwindowed = parse_hf_config(tiny_config("MistralForCausalLM") | {"sliding_window": 10**6})
    assert unwindowed.sliding_window == 0  # a window past the context never masks a key


def test_unknown_architecture_is_refused_naming_the_registered_ones():
    for refuse in (lambda: parse_hf_config(tiny_config("GPTNeoXForCausalLM")), lambda: model_family("GPTNeoXForCausalLM")):
        with pytest.raises(ConfigError, match="unsupported architecture 'GPTNeoXForCausalLM'") as err:
            refuse()
        assert all(arch in str(err.value) for arch in ARCHITECTURES)


# --- GGUF: what llama.cpp names each family's tensors -------------------------------------------

GGUF_FAMILIES = [family for family in FAMILIES if family.gguf_architecture]


def _model_arch(name: str) -> gguf.MODEL_ARCH:
    return next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == name)


def test_every_family_reads_a_gguf_architecture():
    # every generation family; an encoder (models/bert.py) has no GGUF form here
    # (the MoE families' GGUF tensors are stacked experts, read by gguf_reader itself: tests/test_moe.py)
    # (OLMo-3: this gguf-py has no "olmo3" architecture)
    assert [f.name for f in GGUF_FAMILIES] == [f.name for f in FAMILIES if f.task == "generate"
                                               and f.name not in ("qwen3_moe", "mixtral", "olmo3")]
    for family in GGUF_FAMILIES:
        _model_arch(family.gguf_architecture)  # an architecture llama.cpp has
        assert gguf_reader.ARCHITECTURES[family.gguf_architecture] in family.architectures


@pytest.mark.parametrize("family", GGUF_FAMILIES, ids=lambda f: f.name)
def test_gguf_names_cover_the_weight_plan(family):
    """Every HF tensor the family's plan needs has the GGUF name gguf-py gives it for this
    architecture (a tensor the architecture has), and the reader maps that name back."""
    arch = _model_arch(family.gguf_architecture)
    names = gguf.get_tensor_name_map(arch, LAYERS)
    cfg = parse_hf_config(tiny_config(gguf_reader.ARCHITECTURES[family.gguf_architecture]))
    for hf in expected_source_shapes(cfg):
        found = names.get_type_and_name(hf, try_suffixes=(".weight", ".bias"))
        assert found is not None, f"gguf-py has no {family.gguf_architecture} tensor for {hf}"
        kind, gguf_name = found
        assert kind in gguf.MODEL_TENSORS[arch], (hf, kind)
        assert gguf_reader.hf_name(gguf_name, Path("x.gguf"), family.gguf_architecture) == hf


@pytest.mark.parametrize("family", GGUF_FAMILIES, ids=lambda f: f.name)
def test_a_gguf_written_by_gguf_py_reads_into_the_family(family, tmp_path):
    """Metadata keys and tensor names as gguf-py's writer and tables spell them: the reader's
    config normalizes to the family's config of the same model, and the checkpoint holds every
    tensor the plan needs, in its shape."""
    arch = _model_arch(family.gguf_architecture)
    raw = tiny_config(gguf_reader.ARCHITECTURES[family.gguf_architecture])
    want = parse_hf_config(raw)
    names = gguf.get_tensor_name_map(arch, LAYERS)
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), family.gguf_architecture)
    w.add_block_count(raw["num_hidden_layers"])
    w.add_embedding_length(raw["hidden_size"])
    w.add_feed_forward_length(raw["intermediate_size"])
    w.add_head_count(raw["num_attention_heads"])
    w.add_head_count_kv(raw["num_key_value_heads"])
    w.add_key_length(raw["head_dim"])
    w.add_value_length(raw["head_dim"])
    if family.name == "gpt2":  # LayerNorm's epsilon, as llama.cpp's gpt2 converter writes it
        w.add_layer_norm_eps(raw["rms_norm_eps"])
    else:
        w.add_layer_norm_rms_eps(raw["rms_norm_eps"])
    w.add_rope_freq_base(raw["rope_theta"])
    w.add_context_length(raw["max_position_embeddings"])
    w.add_vocab_size(raw["vocab_size"])
    for hf, shape in expected_source_shapes(want).items():
        _kind, gguf_name = names.get_type_and_name(hf, try_suffixes=(".weight", ".bias"))
        if family.name == "gpt2" and hf.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            shape = shape[::-1]  # its converter stores the Conv1D matrices transposed
        w.add_tensor(gguf_name, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ckpt = open_checkpoint(tmp_path / "m.gguf")
    got = parse_hf_config(ckpt.config())
    assert got == want and got.family == family.name
    check_checkpoint_shapes(got, {n: t.shape for n, t in ckpt.tensors().items()}, str(ckpt.path))


# --- what the toolchain hands over instead of an import ------------------------------------------

def test_int8_kernels_are_handed_to_the_model():
    """models/ never imports schedules/: the toolchain gives the decoder the integer-dot kernels
    (Int8GemvKernels); the formats the --activations scheme counts on are the kernels' own."""
    pytest.importorskip("tvm")
    from vtool.models.int8_activations import INT8_FORMATS
    from vtool.schedules.cpu.int8_gemv import FORMATS, Int8GemvKernels

    assert INT8_FORMATS == FORMATS
    cfg = parse_hf_config(tiny_config("LlamaForCausalLM"))
    formats = {module: "Q8_0" for module in weight_modules(cfg)}

    def int8_kernels(mod) -> int:  # noqa: ANN001 - an IRModule
        return sum(1 for f in mod.functions.values()
                   if f.attrs is not None and "vtool.int8_gemv" in f.attrs)

    with_kernels, plan, _ = _export("LlamaForCausalLM", formats, int8_activations="decode",
                                    int8_kernels=Int8GemvKernels("avx2"))
    assert int8_kernels(with_kernels) > 0
    assert any(entry.get("quant") == {"format": "Q8_0", "part": "qweight"} for entry in plan)
    without, _, _ = _export("LlamaForCausalLM", formats, int8_activations="decode")
    assert int8_kernels(without) == 0


def test_gpu_sampler_names_are_the_runtime_calls():
    """schedules/cuda/sampler.py names its functions itself (schedules/ does not import the
    runtime); runtime/sampling/device.py calls them by the same names. Read from the source:
    importing the CUDA schedules loads TVM's tensor intrinsics, a minute on 2 cores
    (tests/test_gpu_sampler.py calls a built sampler through the runtime's names)."""
    from vtool.runtime.sampling import device

    tree = ast.parse((PACKAGE / "schedules" / "cuda" / "sampler.py").read_text())
    consts = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
              and isinstance(node.value, ast.Constant) for target in node.targets if isinstance(target, ast.Name)}
    assert (consts["ARGMAX"], consts["TEMPERATURE"], consts["TOP_P_TOP_K"]) == device.FUNCTIONS
    assert (consts["APPLY_TOKEN_BITMASK"], consts["TOKEN_LOGPROB"]) == device.MASK_FUNCTIONS


@pytest.mark.parametrize("arch", [arch for arch, f in ARCHITECTURES.items() if f.task == "generate"])
def test_decode_in_two_calls_where_the_model_has_them(arch):
    """What a CUDA build asks for (toolchain/build.py splits_decode): decode_hidden and
    decode_logits beside decode wherever the family's module defines them (GPT-2's does not)."""
    tvm = pytest.importorskip("tvm")
    cfg = parse_hf_config(tiny_config(arch))
    model = model_family(arch).module(cfg, "float32", tvm.target.Target("llvm"), None)
    if not hasattr(model, "decode_hidden"):
        assert model_family(arch).name == "gpt2", f"{arch}: only GPT-2 has no decode in two calls"
        return
    model.split_decode = True
    mod, _ = model.export_tvm(spec=model.get_default_spec())
    assert {"decode", "decode_hidden", "decode_logits"} <= {gv.name_hint for gv in mod.functions}
