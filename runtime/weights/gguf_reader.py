"""GGUF files (llama.cpp): metadata -> HF config dict, tensors -> HF names and layout.

Three things differ from a Hugging Face checkpoint and are undone here:
  * names: blk.N.attn_q.weight is model.layers.N.self_attn.q_proj.weight, and so on;
  * shapes: GGUF lists dims innermost first (ne[0]), torch lists them outermost first;
  * the `llama` converter permutes the rows of Q and K so that llama.cpp's rotary
    pairs (2i, 2i+1) line up; HF pairs (i, i + d/2), so those rows are permuted back.
Quantized blocks are expanded with gguf.quants.dequantize, the same code transformers uses.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import mmap
import re
import struct
from pathlib import Path
from typing import Any, Callable

import numpy as np

from vtool.runtime.weights.block_rows import BlockRows
from vtool.runtime.weights.checkpoint import Checkpoint, CheckpointError, TensorInfo, numpy_dtype
from vtool.runtime.weights.ggml_blocks import GGML_TYPES
from vtool.runtime.weights.gguf_gemma import GEMMA_ARCHITECTURES, gemma_config, is_gemma_norm, norm_from_gguf

log = logging.getLogger("vtool.weights")

# llama.cpp's conventions, the file format's and not one model family's (so the runtime reads a GGUF file
# before it has an artifact, and never imports models/): general.architecture -> the HF architectures[0]
# its converter took; each family names the one its files carry (ModelFamily.gguf_architecture), and
# tests/test_model_registry.py holds these tables to gguf-py's for every family.
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    **GEMMA_ARCHITECTURES,  # gemma2, gemma3 (runtime/weights/gguf_gemma.py)
    "gpt2": "GPT2LMHeadModel",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# A "llama" file with experts (llama.expert_count > 0) is Mixtral's: llama.cpp's converter writes it so.
LLAMA_WITH_EXPERTS = "MixtralForCausalLM"
# GGML tensor types load() can expand to floats (gguf-py's dequantizers): every type llama.cpp's
# standard presets write. Those vtool has kernels for stay in blocks on the CPU (ggml_blocks.py);
# the others are expanded at load.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K", "IQ4_NL", "IQ4_XS")
# Rarer types gguf-py can still expand: read, with a notice that they are dequantized (no kernel
# reads them, and their memory is the float copy's).
NOTICE_TYPES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0", "TQ2_0")

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# blk.N.<key> -> model.layers.N.<value>
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_qkv": "self_attn.qkv_proj",  # stored fused (phi3)
    "post_attention_norm": "post_attention_layernorm",  # olmo2: after attention
    "post_ffw_norm": "post_feedforward_layernorm",  # olmo2: after the MLP
}
# Where an architecture's converter stores a tensor under another meaning: phi3's ffn_up holds
# gate|up stacked (2 x feed_forward_length rows), as its HF checkpoint does.
_PER_LAYER_BY_ARCH = {"phi3": {"ffn_up": "mlp.gate_up_proj"},
                      # Gemma's ffn_norm is the norm before the MLP; its norm after attention is post_attention_norm
                      "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
                      "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
                      "qwen3moe": {"ffn_gate_inp": "mlp.gate"},  # the router (qwen3moe)
                      "llama": {"ffn_gate_inp": "block_sparse_moe.gate"}}  # Mixtral's router
# Mixture-of-experts weights, stored stacked [E, rows, cols] (blk.N.ffn_{gate,up,down}_exps): read as the
# per-expert HF tensors model.layers.N.<block>.experts.E.<part>.weight (one slice each), as the HF
# checkpoint stores them. arch -> (block, gate, up, down part names)
_EXPERT_NAMES = {"qwen3moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
                 "llama": ("block_sparse_moe", "w1", "w3", "w2")}
_EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
# Per-frequency rope factors of longrope scaling (Phi-3 128k, Phi-3.5): config()'s rope_scaling carries them
LONGROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_NORMS = {"attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"}  # RMSNorm: weight only
_BLOCK = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
ROPE_FREQS = "rope_freqs.weight"  # llama3-style per-frequency rope divisors, folded into config


@functools.lru_cache(maxsize=None)
def _per_layer(arch: str) -> dict[str, str]:
    """blk.N.<key> -> model.layers.N.<value> for this architecture."""
    return {**_PER_LAYER, **_PER_LAYER_BY_ARCH.get(arch, {})}


# GPT-2 ("gpt2"): HF's GPT2LMHeadModel names, norms with biases. Its converter stores the Conv1D matrices
# (HF [in, out]) transposed; the reader transposes them back, so the checkpoint reads as HF's.
_GPT2_TOP_LEVEL = {"token_embd.weight": "transformer.wte.weight", "position_embd.weight": "transformer.wpe.weight",
                   "output_norm.weight": "transformer.ln_f.weight", "output_norm.bias": "transformer.ln_f.bias",
                   "output.weight": "lm_head.weight"}
_GPT2_PER_LAYER = {"attn_norm": "ln_1", "ffn_norm": "ln_2", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
                   "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
_GPT2_TRANSPOSED = re.compile(r"blk\.\d+\.(attn_qkv|attn_output|ffn_up|ffn_down)\.weight")


def _gpt2_name(gguf_name: str, file: Path) -> str:
    m = _BLOCK.fullmatch(gguf_name)
    if gguf_name in _GPT2_TOP_LEVEL:
        return _GPT2_TOP_LEVEL[gguf_name]
    if m and m[2] in _GPT2_PER_LAYER:
        return f"transformer.h.{int(m[1])}.{_GPT2_PER_LAYER[m[2]]}.{m[3]}"
    raise CheckpointError(f"{file}: gpt2 tensor {gguf_name!r} has no Hugging Face counterpart vtool knows (known: "
                          f"{', '.join(_GPT2_TOP_LEVEL)}, blk.N.{{{','.join(_GPT2_PER_LAYER)}}}.weight/.bias)")


def hf_name(gguf_name: str, file: Path, arch: str = "llama") -> str:
    """The Hugging Face name of a GGUF tensor of general.architecture `arch`; unknown names
    are refused."""
    if arch == "gpt2":
        return _gpt2_name(gguf_name, file)
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    per_layer = _per_layer(arch)
    if m and m[2] in per_layer and not (m[2] in _NORMS and m[3] == "bias"):
        return f"model.layers.{int(m[1])}.{per_layer[m[2]]}.{m[3]}"
    raise CheckpointError(
        f"{file}: tensor {gguf_name!r} has no Hugging Face counterpart vtool knows "
        f"(known: {', '.join(_TOP_LEVEL)}, blk.N.{{{','.join(_PER_LAYER)}}}.weight/.bias)"
    )


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's convert_hf_to_gguf `permute` of Q/K rows (and biases).

    Per head, llama.cpp stores row order (0, d/2, 1, d/2+1, ...); HF wants (0, 1, ..., d-1).
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f32(v: float) -> float:
    # GGUF stores float32: 1e-5 reads back as 9.999999747e-06; the shortest float32
    # repr gives back the number the converter was handed.
    return float(str(np.float32(v)))


def llama3_rope_scaling(factors: np.ndarray, theta: float, rot_dim: int) -> dict[str, Any] | None:
    """Recover HF llama3 rope_scaling from the per-frequency divisors llama.cpp precomputes.

    convert_hf_to_gguf turns (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings) into rope_freqs.weight and stores no scaling keys;
    the four numbers are found again by recomputing the divisors over the values every
    Llama 3.x release uses and keeping the one that reproduces the stored array.
    Returns None when the array is all ones (no scaling); raises ValueError if nothing fits.
    """
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if np.allclose(factors, 1.0):
        return None
    freqs = 1.0 / theta ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)
    if freqs.shape != factors.shape:
        raise ValueError(f"{factors.size} factors for a rotary dimension of {rot_dim}")
    factor = float(factors.max())
    wavelen = 2 * math.pi / freqs
    for orig in (8192, 4096, 2048, 16384, 32768, 65536, 131072):
        for low in (1.0, 2.0, 0.5):
            for high in (4.0, 2.0, 8.0, 1.0):
                if high <= low:
                    continue
                smooth = (orig / wavelen - low) / (high - low)
                want = np.where(
                    wavelen < orig / high, 1.0,
                    np.where(wavelen > orig / low, factor, 1 / ((1 - smooth) / factor + smooth)),
                )
                if np.allclose(want, factors, rtol=1e-4, atol=0):
                    return {
                        "rope_type": "llama3",
                        "factor": _f32(factor),
                        "low_freq_factor": low,
                        "high_freq_factor": high,
                        "original_max_position_embeddings": orig,
                    }
    raise ValueError("the divisors match no llama3 rope scaling")


class _Truncated(Exception):
    pass


# --- a light GGUF reader -----------------------------------------------------------------------------
# gguf.GGUFReader maps the whole file and builds numpy views for every part of every
# metadata value: for a 49K-token vocabulary (tokens, token types, merges) that is ~175 MB
# of Python objects and 2-3 s, held as long as the reader lives (and the runtime opened it
# twice: once for the config, once for the tokenizer). This reads the same header into plain
# Python values, in one pass over a temporary map of the file, and keeps per tensor only its
# place in the file; a float tensor's bytes are mapped when asked for and unmapped with the
# array. Same values as GGUFReader's field.contents() (tests hold the two equal).

READER_VERSIONS = (2, 3)
# What the checkpoint does not keep (the tokenizer reads them itself): ~10 MB of strings for 49K tokens
TOKENIZER_ARRAYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                              "tokenizer.ggml.scores"})
DEFAULT_ALIGNMENT = 32
_SCALARS: dict[int, str] = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
                            10: "<u8", 11: "<i8", 12: "<f8"}  # GGUFValueType -> numpy dtype
_STRING, _ARRAY = 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_FLOAT_ITEMS = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}


GGUF_MAGIC = 0x46554747  # b"GGUF" read as a little-endian uint32


# GGML_TYPES (ggml_blocks) names the types vtool meets; the gguf package itself (numpy + yaml + ...,
# ~5 MB resident) is imported only to expand a tensor or for a type not listed there.
@dataclasses.dataclass(frozen=True)
class GGMLType:
    """A tensor's GGML type: `.name` and `.value` as gguf.GGMLQuantizationType's."""

    value: int
    name: str
    block: int
    type_size: int

    @classmethod
    def of(cls, raw: int) -> "GGMLType":
        known = GGML_TYPES.get(raw)
        if known is None:
            import gguf

            t = gguf.GGMLQuantizationType(raw)  # ValueError for an unknown id
            known = (t.name, *gguf.GGML_QUANT_SIZES[t])
        return cls(raw, *known)


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor's entry (the subset of gguf.ReaderTensor vtool reads)."""

    name: str
    tensor_type: GGMLType
    shape: np.ndarray  # GGUF order (ne[0] = innermost), as gguf.ReaderTensor.shape
    n_elements: int
    n_bytes: int
    data_offset: int  # absolute byte offset in the file
    path: Path

    @property
    def data(self) -> np.ndarray:
        """The bytes in the file, mapped read-only, shaped as gguf.ReaderTensor.data: float and
        integer types as their dtype, block types as uint8 [..., bytes per row]."""
        dims = tuple(reversed([int(d) for d in self.shape]))
        item = _FLOAT_ITEMS.get(self.tensor_type.name)
        if item is None:
            t = self.tensor_type
            item, dims = np.uint8, (*dims[:-1], dims[-1] // t.block * t.type_size)
        return np.memmap(self.path, dtype=item, mode="r", offset=self.data_offset, shape=dims)


class _Cursor:
    def __init__(self, buf: Any):
        self.buf, self.pos, self.size = buf, 0, len(buf)

    def _need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise ValueError(f"the header runs past the end of the file ({self.size} bytes) at byte {self.pos}")

    def u32(self) -> int:
        self._need(4)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self) -> int:
        self._need(8)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self) -> str:
        n = self.u64()
        self._need(n)
        v = str(self.buf[self.pos:self.pos + n], encoding="utf-8")
        self.pos += n
        return v

    def scalars(self, vtype: int, count: int) -> list[Any]:
        dtype = np.dtype(_SCALARS[vtype])
        self._need(count * dtype.itemsize)
        v = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
        self.pos += count * dtype.itemsize
        return v

    def value(self, vtype: int, keep: bool) -> Any:
        """One value of type `vtype`; with keep False it is skipped (None)."""
        if vtype == _STRING:
            if keep:
                return self.string()
            n = self.u64()
            self._need(n)
            self.pos += n
            return None
        if vtype in _SCALARS:
            if not keep:
                size = np.dtype(_SCALARS[vtype]).itemsize
                self._need(size)
                self.pos += size
                return None
            return self.scalars(vtype, 1)[0]
        if vtype == _ARRAY:
            sub, count = self.u32(), self.u64()
            if sub in _SCALARS:
                if keep:
                    return self.scalars(sub, count)
                size = count * np.dtype(_SCALARS[sub]).itemsize
                self._need(size)
                self.pos += size
                return None
            if sub == _STRING and keep:
                return [self.string() for _ in range(count)]
            items = [self.value(sub, keep) for _ in range(count)]
            return items if keep else None
        raise ValueError(f"unknown GGUF value type {vtype} at byte {self.pos}")


class GGUFFile:
    """A GGUF file's header: `fields` (key -> Python value, as gguf's field.contents()),
    `tensors` (GGUFTensor, in file order), `version`, `byte_order` ("I" native little-endian,
    "S" swapped: refused by the callers). `keep(key)` False skips a value (it is not decoded).
    Raises ValueError (bad magic, version, duplicate key or tensor, bad alignment), KeyError
    (an unknown tensor type) or _Truncated."""

    def __init__(self, path: str | Path, keep: Callable[[str], bool] | None = None):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = f.seek(0, 2)
            if size < 8:
                raise ValueError(f"{size} bytes: too short for a GGUF header")
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                self._parse(m, size, keep)
            finally:
                try:
                    m.close()
                except BufferError:  # a numpy view still alive in an exception's traceback
                    pass

    def _parse(self, buf: mmap.mmap, size: int, keep: Callable[[str], bool] | None) -> None:
        c = _Cursor(buf)
        if c.u32() != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version = c.u32()
        self.byte_order = "I"
        if version & 0xFFFF == 0:  # written for the other byte order
            self.byte_order, self.version, self.fields, self.tensors, self.array_lengths = "S", version, {}, [], {}
            return
        if version not in READER_VERSIONS:
            raise ValueError(f"GGUF version {version}; readable: {', '.join(map(str, READER_VERSIONS))}")
        self.version = version
        self.array_lengths: dict[str, int] = {}  # key -> items, for the arrays `keep` skipped
        n_tensors, n_kv = c.u64(), c.u64()
        fields: dict[str, Any] = {}
        skipped: set[str] = set()
        for _ in range(n_kv):
            key = c.string()
            if key in fields or key in skipped:
                raise KeyError(f"Duplicate {key} already in list at offset {c.pos}")
            vtype = c.u32()
            if keep is None or keep(key) or key == "general.alignment":
                fields[key] = c.value(vtype, True)
            else:
                if vtype == _ARRAY:  # its length, for free
                    self.array_lengths[key] = _U64.unpack_from(buf, c.pos + 4)[0] if c.pos + 12 <= size else 0
                c.value(vtype, False)
                skipped.add(key)
        entries = []
        for _ in range(n_tensors):
            name = c.string()
            dims = [c.u64() for _ in range(c.u32())]
            entries.append((name, dims, c.u32(), c.u64()))
        alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"Invalid alignment {alignment!r}: must be a non-zero power of two")
        start = -(-c.pos // alignment) * alignment
        self.fields = {k: v for k, v in fields.items() if keep is None or keep(k)}
        tensors, names = [], set()
        for name, dims, raw_type, offset in entries:
            if name in names:
                raise ValueError(f"Found duplicated tensor with name {name}")
            names.add(name)
            ttype = GGMLType.of(raw_type)
            block, type_size = ttype.block, ttype.type_size
            n = math.prod(dims)
            n_bytes = n * type_size // block
            end = start + offset + n_bytes
            if end > size:
                raise _Truncated(f"truncated: tensor {name!r} ends at byte {end} but the file has {size} bytes")
            tensors.append(GGUFTensor(name, ttype, np.asarray(dims, dtype=np.uint64), n, n_bytes, start + offset,
                                      self.path))
        self.tensors = tensors


class GGUFCheckpoint(Checkpoint):
    format = "gguf"

    def __init__(self, file: Path):
        self.path = file
        with open(file, "rb") as f:
            if f.read(4) != b"GGUF":
                raise CheckpointError(f"{file}: not a GGUF file (no GGUF magic)")
        self._reader_obj: GGUFFile | None = None  # the header, read on first use
        self._config: dict[str, Any] | None = None
        self._infos: dict[str, TensorInfo] | None = None
        self._raw: dict[str, Any] = {}  # HF name -> gguf ReaderTensor
        # an expert's HF name -> (its stacked tensor, its index); the last few stacked tensors expanded
        self._experts: dict[str, tuple[GGUFTensor, int]] = {}
        self._stacked: dict[str, np.ndarray] = {}
        self._metadata: dict[str, Any] | None = None

    # -- file access ----------------------------------------------------------------
    @property
    def _reader(self) -> GGUFFile:
        """The header without the tokenizer's big arrays (the tokenizer reads those itself);
        metadata() reads the whole header again."""
        if self._reader_obj is None:
            reader = self._open(keep=lambda key: key not in TOKENIZER_ARRAYS)
            self._reader_obj = reader
        return self._reader_obj

    def _open(self, keep: Callable[[str], bool] | None) -> GGUFFile:
        try:
            reader = GGUFFile(self.path, keep)
        except _Truncated as e:
            raise CheckpointError(f"{self.path}: {e}") from None
        except Exception as e:  # the reader reports truncation/corruption as assorted errors
            raise CheckpointError(
                f"{self.path}: unreadable GGUF file (truncated or corrupt): {type(e).__name__}: {e}"
            ) from None
        if reader.byte_order != "I":
            raise CheckpointError(f"{self.path}: big-endian GGUF files are not supported")
        return reader

    def _get(self, key: str, default: Any = KeyError) -> Any:
        fields = self._reader.fields
        if key not in fields:
            if default is KeyError:
                raise CheckpointError(f"{self.path}: GGUF metadata lacks required key {key!r}")
            return default
        return fields[key]

    def _scalar(self, key: str, default: Any = KeyError) -> Any:
        v = self._get(key, default)
        if isinstance(v, list):  # some models vary this per layer; vtool's models do not
            raise CheckpointError(f"{self.path}: GGUF key {key!r} is a per-layer list {v[:8]}...; expected one value")
        return v

    def metadata(self) -> dict[str, Any]:
        """Every GGUF key-value as Python values (arrays as lists), header fields excluded."""
        if self._metadata is None:
            self._metadata = dict(self._open(keep=None).fields)  # GGUF.* header fields are not in it
        return dict(self._metadata)

    # -- config ---------------------------------------------------------------------
    def _arch(self) -> str:
        arch = self._scalar("general.architecture")
        if arch not in ARCHITECTURES:
            raise CheckpointError(
                f"{self.path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
            )
        return arch

    def config(self) -> dict[str, Any]:
        if self._config is None:
            self._config = self._build_config()
        return dict(self._config)

    def _build_config(self) -> dict[str, Any]:
        arch = self._arch()
        if arch == "gpt2":
            return self._gpt2_config()
        k = lambda suffix: f"{arch}.{suffix}"  # noqa: E731
        names = {t.name: t for t in self._reader.tensors}
        hidden = int(self._scalar(k("embedding_length")))
        heads = int(self._scalar(k("attention.head_count")))
        kv_heads = int(self._scalar(k("attention.head_count_kv"), heads))
        rope_dims = self._scalar(k("rope.dimension_count"), None)
        if arch == "phi3":  # its rope may cover part of a head (Phi-4-mini): the head is hidden / heads
            head_dim = int(self._scalar(k("attention.key_length"), None) or hidden // heads)
        else:
            head_dim = int(self._scalar(k("attention.key_length"), None) or rope_dims or hidden // heads)
        value_dim = self._scalar(k("attention.value_length"), head_dim)
        if value_dim != head_dim:
            raise CheckpointError(
                f"{self.path}: {k('attention.value_length')}={value_dim} differs from the key length {head_dim}; "
                "vtool supports equal key and value head sizes only"
            )
        vocab = self._scalar(k("vocab_size"), None)
        if vocab is None and "token_embd.weight" in names:
            vocab = int(names["token_embd.weight"].shape[1])  # ne[1] = rows of the embedding
        if vocab is None:
            vocab = self._reader.array_lengths.get("tokenizer.ggml.tokens")
        theta = _f32(self._scalar(k("rope.freq_base"), 10000.0))
        cfg: dict[str, Any] = {
            "architectures": [ARCHITECTURES[arch]],
            "model_type": arch,
            "vocab_size": None if vocab is None else int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self._scalar(k("feed_forward_length"))),
            "num_hidden_layers": int(self._scalar(k("block_count"))),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": _f32(self._scalar(k("attention.layer_norm_rms_epsilon"), 1e-6)),
            "rope_theta": theta,
            "rope_scaling": self._rope_scaling(arch, theta, head_dim, names),
            "max_position_embeddings": int(self._scalar(k("context_length"), 2048)),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
        }
        if arch == "llama":
            cfg["mlp_bias"] = "blk.0.ffn_gate.bias" in names
        experts = self._scalar(k("expert_count"), None)
        if arch in _EXPERT_NAMES and experts:  # a mixture of experts (models/moe_weights.py reads these)
            if arch == "llama":
                cfg["architectures"] = [LLAMA_WITH_EXPERTS]
                cfg["num_local_experts"] = int(experts)
            else:
                cfg["num_experts"] = int(experts)
                cfg["moe_intermediate_size"] = int(self._scalar(k("expert_feed_forward_length")))
                # llama.cpp's qwen3moe graph always renormalizes the chosen experts' weights
                cfg["norm_topk_prob"] = bool(self._scalar(k("expert_weights_norm"), True))
            cfg["num_experts_per_tok"] = int(self._scalar(k("expert_used_count")))
        if arch == "phi3":
            window = int(self._scalar(k("attention.sliding_window"), 0) or 0)
            if window:
                cfg["sliding_window"] = window
            if rope_dims is not None and int(rope_dims) != head_dim:
                cfg["partial_rotary_factor"] = int(rope_dims) / head_dim  # normalize refuses it, by name
            found = [n for n in LONGROPE_FACTORS if n in names]
            if found:  # longrope (Phi-3 128k, Phi-3.5): HF's rope_scaling from the factor tensors
                cfg["rope_scaling"] = self._longrope(k, found, names)
        if arch in GEMMA_ARCHITECTURES:
            cfg.update(gemma_config(arch, self._scalar, self._get, cfg))
        for hf_key, gguf_key in (
            ("bos_token_id", "bos_token_id"),
            ("eos_token_id", "eos_token_id"),
            ("pad_token_id", "padding_token_id"),
        ):
            v = self._scalar(f"tokenizer.ggml.{gguf_key}", None)
            if v is not None:
                cfg[hf_key] = int(v)
        return cfg

    def _gpt2_config(self) -> dict[str, Any]:
        """A gpt2 file's config in GPT2Config's own keys. The converter writes feed_forward_length
        as 4 x n_embd whatever n_inner is, so n_inner comes from ffn_up's shape; vocab_size from
        token_embd's."""
        names = {t.name: t for t in self._reader.tensors}
        for needed in ("token_embd.weight", "blk.0.ffn_up.weight"):
            if needed not in names:
                raise CheckpointError(f"{self.path}: gpt2 file without tensor {needed!r}")
        cfg: dict[str, Any] = {
            "architectures": [ARCHITECTURES["gpt2"]],
            "model_type": "gpt2",
            "vocab_size": int(names["token_embd.weight"].shape[1]),
            "n_embd": int(self._scalar("gpt2.embedding_length")),
            "n_inner": int(names["blk.0.ffn_up.weight"].shape[1]),
            "n_layer": int(self._scalar("gpt2.block_count")),
            "n_head": int(self._scalar("gpt2.attention.head_count")),
            "n_positions": int(self._scalar("gpt2.context_length")),
            "layer_norm_epsilon": _f32(self._scalar("gpt2.attention.layer_norm_epsilon")),
            "activation_function": "gelu_new",
            "tie_word_embeddings": "output.weight" not in names,
        }
        for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                                 ("pad_token_id", "padding_token_id")):
            v = self._scalar(f"tokenizer.ggml.{gguf_key}", None)
            if v is not None:
                cfg[hf_key] = int(v)
        return cfg

    def _longrope(self, k: Callable[[str], str], found: list[str], names: dict[str, Any]) -> dict[str, Any]:
        """llama.cpp's phi3 longrope (rope_factors_long/short, rope.scaling.original_context_length,
        rope.scaling.attn_factor) as HF's rope_scaling; models/phi3.py picks one factor set."""
        original = self._scalar(k("rope.scaling.original_context_length"), None)
        if len(found) != 2 or original is None:
            raise CheckpointError(f"{self.path}: longrope needs both {' and '.join(LONGROPE_FACTORS)} and "
                                  f"{k('rope.scaling.original_context_length')}; found {', '.join(found)}")
        scaling: dict[str, Any] = {"rope_type": "longrope", "original_max_position_embeddings": int(original)}
        for name, key in zip(LONGROPE_FACTORS, ("long_factor", "short_factor")):
            scaling[key] = [float(v) for v in self._expand(names[name]).reshape(-1)]
        attn = self._scalar(k("rope.scaling.attn_factor"), None)
        if attn is not None:
            scaling["attention_factor"] = _f32(attn)
        return scaling

    def _yarn(self, arch: str, factor: Any) -> dict[str, Any]:
        """llama.cpp's yarn keys as HF's rope_scaling, with llama.cpp's meaning (llama-context.cpp):
        the attention factor is 0.1 ln(factor) + 1 (with yarn_log_multiplier m: that over
        0.1 m ln(factor) + 1), times rope.scaling.attn_factor; yarn_attn_factor, where a converter
        wrote HF's attention_factor, is recomputed by llama.cpp and so not read. An extrapolation
        factor other than 1 is refused by name (transformers' YaRN has none)."""
        def key(name: str) -> str:
            return f"{arch}.rope.scaling.{name}"

        original = self._scalar(key("original_context_length"), None)
        if factor is None or original is None:
            raise CheckpointError(f"{self.path}: yarn rope scaling needs {key('factor')} and "
                                  f"{key('original_context_length')}")
        ext = self._scalar(key("yarn_ext_factor"), None)
        if ext is not None and float(ext) not in (-1.0, 1.0):  # -1: unset, as llama.cpp reads it
            raise CheckpointError(f"{self.path}: {key('yarn_ext_factor')} = {float(ext)} is not supported "
                                  "(YaRN with the full ramp, 1.0, only)")
        factor = _f32(factor)
        log_mul = float(self._scalar(key("yarn_log_multiplier"), 0.0) or 0.0)

        def mscale(m: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

        attention = mscale(1.0) / mscale(log_mul) if log_mul else mscale(1.0)
        attention *= float(self._scalar(key("attn_factor"), 1.0))
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": factor,
                                   "original_max_position_embeddings": int(original), "attention_factor": attention}
        for name, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = self._scalar(key(name), None)
            if value is not None:
                scaling[hf] = _f32(value)
        return scaling

    def _rope_scaling(self, arch: str, theta: float, head_dim: int, names: dict[str, Any]) -> dict[str, Any] | None:
        kind_key = f"{arch}.rope.scaling.type"
        kind = self._scalar(kind_key, None)
        factor = self._scalar(f"{arch}.rope.scaling.factor", None)
        if factor is None:
            factor = self._scalar(f"{arch}.rope.scale_linear", None)  # pre-2024 spelling of linear scaling
            if kind is None and factor not in (None, 1.0):
                kind = "linear"
        scaling: dict[str, Any] | None
        if kind in (None, "none"):
            scaling = None
        elif kind == "linear":
            scaling = {"rope_type": "linear", "factor": _f32(factor if factor is not None else 1.0)}
        elif kind == "yarn":
            scaling = self._yarn(arch, factor)
        else:
            raise CheckpointError(
                f"{self.path}: rope scaling {kind!r} ({kind_key}) is not supported; "
                "supported: none, linear, yarn, llama3 (as rope_freqs.weight)"
            )
        if ROPE_FREQS in names:
            if scaling is not None:
                raise CheckpointError(f"{self.path}: both {kind_key}={kind!r} and {ROPE_FREQS}; expected one")
            rot_dim = int(self._scalar(f"{arch}.rope.dimension_count", head_dim))
            try:
                scaling = llama3_rope_scaling(self._expand(names[ROPE_FREQS]), theta, rot_dim)
            except ValueError as e:
                raise CheckpointError(
                    f"{self.path}: tensor {ROPE_FREQS!r} holds per-frequency rope divisors vtool cannot map "
                    f"to a supported rope scaling (none, linear, llama3): {e}"
                ) from None
        return scaling

    def generation_config(self) -> dict[str, Any] | None:
        return None  # GGUF carries no generation defaults

    # -- tensors --------------------------------------------------------------------
    def tensors(self) -> dict[str, TensorInfo]:
        if self._infos is None:
            infos: dict[str, TensorInfo] = {}
            noticed: dict[str, list[str]] = {}
            arch = self._arch()
            for t in self._reader.tensors:
                if t.name == ROPE_FREQS or (t.name in LONGROPE_FACTORS and arch == "phi3"):
                    continue  # not a weight in HF: config()'s rope_scaling carries it
                kind = t.tensor_type.name
                m = _EXPERT_TENSOR.fullmatch(t.name)
                if m and arch in _EXPERT_NAMES:
                    if kind not in SUPPORTED_TYPES + NOTICE_TYPES:
                        raise CheckpointError(f"{self.path}: tensor {t.name!r} has GGML type {kind}; supported: "
                                              f"{', '.join(SUPPORTED_TYPES + NOTICE_TYPES)}")
                    if len(t.shape) != 3:
                        raise CheckpointError(f"{self.path}: expert tensor {t.name!r} has shape "
                                              f"{tuple(int(d) for d in reversed(t.shape.tolist()))}; expected "
                                              "[experts, rows, columns]")
                    block, *parts = _EXPERT_NAMES[arch]
                    part = parts[("gate", "up", "down").index(m[2])]
                    *_, rows, cols = (int(d) for d in reversed(t.shape.tolist()))
                    for e in range(int(t.shape[-1])):  # ne[2]: the experts
                        name = f"model.layers.{int(m[1])}.{block}.experts.{e}.{part}.weight"
                        self._experts[name] = (t, e)
                        infos[name] = TensorInfo(name, (rows, cols), kind)
                    continue
                name = hf_name(t.name, self.path, arch)
                if kind in NOTICE_TYPES:
                    noticed.setdefault(kind, []).append(t.name)
                elif kind not in SUPPORTED_TYPES:
                    raise CheckpointError(
                        f"{self.path}: tensor {t.name!r} has GGML type {kind}; supported: "
                        f"{', '.join(SUPPORTED_TYPES + NOTICE_TYPES)}"
                    )
                self._raw[name] = t
                shape = tuple(int(d) for d in reversed(t.shape.tolist()))
                if arch == "gpt2" and _GPT2_TRANSPOSED.fullmatch(t.name):
                    shape = shape[::-1]  # HF's Conv1D [in, out]: _hf_rows transposes it back
                infos[name] = TensorInfo(name, shape, kind)
            for kind, names in noticed.items():
                log.warning("%s: %d tensor(s) of GGML type %s (%s%s) are dequantized at load: no kernel reads "
                            "that type", self.path.name, len(names), kind, ", ".join(names[:3]),
                            ", ..." if len(names) > 3 else "")
            self._infos = infos
        return self._infos

    def _expand(self, t: Any) -> np.ndarray:
        """A GGUF tensor as floats in torch dim order; F16/BF16 stay in their own dtype."""
        kind = t.tensor_type.name
        data = t.data.view(np.ndarray)  # drop np.memmap: a plain view of the mapped bytes
        if kind in ("F32", "F16"):
            arr = data
        elif kind == "BF16":
            arr = data.view(numpy_dtype("bfloat16"))  # stored as raw bytes, 2 per element
        else:
            import gguf  # only here: see GGMLType

            arr = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(t.tensor_type.value))
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        return arr.reshape(shape)

    def _load_raw(self, name: str) -> np.ndarray:
        if name in self._experts:  # one expert's slice of a stacked tensor, expanded once for all experts
            t, e = self._experts[name]
            if t.name not in self._stacked:
                if len(self._stacked) >= 3:  # a layer's gate, up and down stacks: the plan reads them in turn
                    self._stacked.pop(next(iter(self._stacked)))
                self._stacked[t.name] = self._expand(t)
            return self._stacked[t.name][e]
        t = self._raw[name]
        arr = self._hf_rows(t, self._expand(t))
        return norm_from_gguf(arr) if is_gemma_norm(self._arch(), name) else arr  # stored as 1 + w

    def load_blocks(self, name: str) -> tuple[str, np.ndarray]:
        rows = self.block_rows(name)
        return rows.kind, rows.read(0, rows.rows)

    def block_rows(self, name: str) -> BlockRows:
        """Where a quantized tensor's blocks lie, to be read a few HF rows at a time (the
        binder streams them: runtime/weights/block_rows.py). Read, not mapped: a mapped page
        counts in this process's resident memory until the mapping goes, and the bytes only
        pass through on their way to being repacked."""
        if name not in self.tensors():
            raise CheckpointError(f"{self.path}: no tensor named {name!r}")
        t = self._raw[name]
        kind = t.tensor_type.name
        if kind in ("F32", "F16", "BF16"):
            raise CheckpointError(f"{self.path}: tensor {t.name!r} is {kind}, not quantized blocks")
        row_bytes = int(t.data.shape[-1])  # uint8 [rows, row_bytes]: blocks never straddle rows
        rows = int(t.n_bytes) // row_bytes
        # Each row's index as 8 bytes, through _hf_rows' own reordering (or refusal) of block rows.
        order = self._hf_rows(t, np.arange(rows, dtype=np.int64).view(np.uint8).reshape(rows, 8))
        order = np.ascontiguousarray(order).view(np.int64).reshape(rows)
        same = bool((order == np.arange(rows)).all())
        return BlockRows(kind, self.path, int(t.data_offset), rows, row_bytes, None if same else order)

    def _hf_rows(self, t: Any, arr: np.ndarray) -> np.ndarray:
        """Q/K rows of the `llama` converter back in HF order (floats or block rows alike);
        the `gpt2` converter's transposed Conv1D matrices back in HF's [in, out] (floats only)."""
        if self._arch() == "gpt2" and _GPT2_TRANSPOSED.fullmatch(t.name):
            if arr.dtype == np.uint8:
                raise CheckpointError(f"{self.path}: gpt2 tensor {t.name!r} is stored transposed from HF's layout; "
                                      "its blocks cannot be kept (it is dequantized at load)")
            return arr.T
        if self._arch() == "llama" and re.search(r"\.attn_[qk]\.", t.name):
            cfg = self.config()
            n_head = cfg["num_attention_heads"] if ".attn_q." in t.name else cfg["num_key_value_heads"]
            if arr.shape[0] % (2 * n_head):
                raise CheckpointError(
                    f"{self.path}: tensor {t.name!r} has {arr.shape[0]} rows, not a multiple of 2 x {n_head} heads"
                )
            arr = unpermute_rows(arr, n_head)
        return arr
