"""GGUF quantized blocks, repacked at load into the arrays vtool's quantized kernels read.

The formats, their parts and the parts' layout are defined once, in
vtool.runtime.weights.ggml_blocks (its docstring draws them). This module turns a GGUF
tensor's block bytes into those arrays (`repack`) and back into floats (`dequantize`, what
the kernels compute, in numpy). Every dequantization is exact in float32 up to gguf-py's own
one rounding (Q4_1's and Q4_K's subtraction or addition), so the kernels reproduce
gguf.quants.dequantize bit for bit. No float copy of a weight is ever made.

Nothing here imports TVM: the runtime binds weights with it, following the manifest.
"""
from __future__ import annotations

import numpy as np

from vtool import VtoolError
from vtool.runtime.weights.ggml_blocks import BLOCK, FORMATS, IQ4_VALUES, TILE_ROWS, BlockFormat

class QuantFormatError(VtoolError):
    """A quantized tensor vtool cannot repack (unknown format, wrong byte count)."""


def block_format(name: str) -> BlockFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise QuantFormatError(f"no quantized kernel for GGML type {name}; vtool keeps {', '.join(FORMATS)}") from None


def _blocks(fmt: BlockFormat, raw: np.ndarray, cols: int) -> np.ndarray:
    """raw bytes [rows, row_bytes] -> [rows, cols/block_weights, block_bytes], checking sizes."""
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 2:
        raise QuantFormatError(f"{fmt.name} data must be uint8 [rows, bytes], got {raw.dtype} {list(raw.shape)}")
    rows = raw.shape[0]
    if cols % fmt.block_weights or rows % TILE_ROWS:
        raise QuantFormatError(f"{fmt.name} weight [{rows}, {cols}]: kept blocks need rows divisible by "
                               f"{TILE_ROWS} and columns by {fmt.block_weights}")
    want = cols // fmt.block_weights * fmt.block_bytes
    if raw.shape[1] != want:
        raise QuantFormatError(f"{fmt.name} data of shape {list(raw.shape)}: expected [rows, {want}] bytes "
                               f"for {cols} weights per row")
    return raw.reshape(rows, cols // fmt.block_weights, fmt.block_bytes)


def _tile(a: np.ndarray) -> np.ndarray:
    """[rows, n, ...] -> [rows/4, n, 4, ...]: the tiled, block-major order (a fresh array)."""
    a = a.reshape(a.shape[0] // TILE_ROWS, TILE_ROWS, *a.shape[1:])
    return np.ascontiguousarray(np.swapaxes(a, 1, 2))


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16)[..., 0]


def _regroup_nibbles(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF K-quant nibbles [..., 2, 16] (bytes l and 16 + l of 32 whose low nibbles are 32
    weights and high nibbles the next 32) -> the two 32-weight blocks in Q4_0's order."""
    a, c = pairs[..., 0, :], pairs[..., 1, :]
    return (a & 15) | (c << 4), (a >> 4) | (c & 0xF0)


def q4k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of a Q4_K block [..., 12] -> 6-bit (sc, m) [..., 8] uint8
    (ggml-quants get_scale_min_k4)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _repack_q4k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    rows, nsb, _ = blocks.shape
    lo, hi = _regroup_nibbles(blocks[..., 16:144].reshape(rows, nsb, 4, 2, 16))
    qweight = np.stack([lo, hi], axis=3).reshape(rows, nsb * 8, 16)  # [.., group, nibble, 16]
    sc, mn = q4k_scale_min(blocks[..., 4:16])
    return {"qweight": _tile(qweight), "scale": _tile(_f16(blocks, 0)), "min": _tile(_f16(blocks, 2)),
            "sub_scale": _tile(sc.reshape(rows, nsb * 8)), "sub_min": _tile(mn.reshape(rows, nsb * 8))}


def _bit_planes(qh: np.ndarray) -> np.ndarray:
    """32 bytes per 256 weights whose bit s of byte l is element l of the 32 weights s (Q5_K's
    qh, Q3_K's hmask) [rows, nsb, 32] -> each 32's bits as Q5_0's qhigh, tiled [rows/4, nsb*8, 4, 4]."""
    rows, nsb, _ = qh.shape
    bits = (qh[..., None] >> np.arange(8, dtype=np.uint8)) & 1  # [rows, nsb, l, s]
    qhigh = np.packbits(np.swapaxes(bits, -1, -2), axis=-1, bitorder="little")  # [rows, nsb, s, 4]
    return _tile(qhigh.reshape(rows, nsb * 8, 4))


def _two_bit_groups(qs: np.ndarray) -> np.ndarray:
    """2-bit fields, per 128 weights 32 bytes whose byte l holds weight 32k + l at bits 2k..2k+1
    (Q6_K's qh, Q3_K's and Q2_K's qs) [rows, nsb, 64] -> per 64 weights 16 bytes whose byte j holds
    weight 16k + j at bits 2k..2k+1: [rows, nsb * 4, 16]. Byte j of 64-weight group e of a half
    needs weights 64e + 16k' + j: bits 2(2e + k'//2) of byte 16(k' % 2) + j."""
    rows, nsb, _ = qs.shape
    qh = qs.reshape(rows, nsb, 2, 2, 16)
    groups = []
    for e in (0, 4):  # shift that brings group e's two 2-bit fields to bits 0..3
        a, c = qh[..., 0, :] >> e, qh[..., 1, :] >> e
        groups.append((a & 3) | ((c & 3) << 2) | ((a & 12) << 2) | ((c & 12) << 4))
    return np.stack(groups, axis=3).reshape(rows, nsb * 4, 16)  # [.., half, group, 16]


def _repack_q5k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """Q5_K: d, dmin, the 12 scale bytes, then 32 bytes qh (bit s of byte l = element l of
    sub-block s), then Q4_K's 128 bytes of nibbles."""
    parts = _repack_q4k(np.concatenate([blocks[..., :16], blocks[..., 48:]], axis=-1))
    return {"qweight": parts["qweight"], "qhigh": _bit_planes(blocks[..., 16:48]),
            **{p: parts[p] for p in ("scale", "min", "sub_scale", "sub_min")}}


def _repack_q3k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """Q3_K: 32 bytes hmask (bit s of byte l: element 32s + l's third bit), 64 bytes of 2-bit
    quants, 12 bytes of packed 6-bit scales, float16 d (gguf-py's dequantize_blocks order)."""
    rows, nsb, _ = blocks.shape
    packed = blocks[..., 96:108]
    low = (packed[..., None, :8] >> np.array([0, 4], np.uint8)[:, None]).reshape(rows, nsb, 16) & 15
    high = (packed[..., None, 8:] >> np.array([0, 2, 4, 6], np.uint8)[:, None]).reshape(rows, nsb, 16) & 3
    sc = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
    return {"qweight": _tile(_two_bit_groups(blocks[..., 32:96])), "qhigh": _bit_planes(blocks[..., :32]),
            "scale": _tile(_f16(blocks, 108)), "sub_scale": _tile(sc.reshape(rows, nsb * 16))}


def _repack_q2k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """Q2_K: 16 bytes of 4-bit scale | min << 4, 64 bytes of 2-bit quants, float16 d, dmin."""
    rows, nsb, _ = blocks.shape
    return {"qweight": _tile(_two_bit_groups(blocks[..., 16:80])), "scale": _tile(_f16(blocks, 80)),
            "min": _tile(_f16(blocks, 82)), "sub_scale": _tile(np.ascontiguousarray(blocks[..., :16]).reshape(
                rows, nsb * 16))}


def _repack_q6k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    rows, nsb, _ = blocks.shape
    # ql: per 128 weights, 64 bytes: low nibbles weights 0..63, high nibbles 64..127
    lo, hi = _regroup_nibbles(blocks[..., :128].reshape(rows, nsb, 2, 2, 2, 16))
    qweight = np.stack([lo, hi], axis=3).reshape(rows, nsb * 8, 16)  # [.., half, nibble, pair, 16]
    # qh: per 128 weights, 32 bytes: byte l bits 2k..2k+1 = weight 32k + l
    return {"qweight": _tile(qweight), "qhigh": _tile(_two_bit_groups(blocks[..., 128:192])),
            "scale": _tile(_f16(blocks, 208)),
            "sub_scale": _tile(blocks[..., 192:208].view(np.int8).reshape(rows, nsb * 16))}


def _repack_iq4xs(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """IQ4_XS: float16 d, uint16 scales_h (2 high bits per 32), 4 bytes scales_l (4 low bits per
    32), then 16 bytes of nibbles per 32 in Q4_0's order."""
    rows, nsb, _ = blocks.shape
    high = np.ascontiguousarray(blocks[..., 2:4]).view("<u2")  # [rows, nsb, 1]
    low = (blocks[..., 4:8, None] >> np.array([0, 4], np.uint8)).reshape(rows, nsb, 8) & 15
    high = ((high >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)
    sc = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
    return {"qweight": _tile(blocks[..., 8:].reshape(rows, nsb * 8, 16)), "scale": _tile(_f16(blocks, 0)),
            "sub_scale": _tile(sc.reshape(rows, nsb * 8))}


def repack(format_name: str, raw: np.ndarray, cols: int) -> dict[str, np.ndarray]:
    """GGUF blocks of a [rows, cols] tensor (raw bytes [rows, cols/block_weights * block_bytes])
    -> the parts the kernels read (see the module docstring)."""
    fmt = block_format(format_name)
    blocks = _blocks(fmt, raw, cols)
    if fmt.name == "Q4_K":
        return _repack_q4k(blocks)
    if fmt.name == "Q6_K":
        return _repack_q6k(blocks)
    if fmt.name == "Q5_K":
        return _repack_q5k(blocks)
    if fmt.name == "Q3_K":
        return _repack_q3k(blocks)
    if fmt.name == "Q2_K":
        return _repack_q2k(blocks)
    if fmt.name == "IQ4_XS":
        return _repack_iq4xs(blocks)
    parts = {"scale": _tile(_f16(blocks, 0)), "qweight": _tile(blocks[..., fmt.header:])}
    if fmt.name == "Q8_0":
        parts["qweight"] = parts["qweight"].view(np.int8)
    if fmt.name in ("Q4_1", "Q5_1"):
        parts["min"] = _tile(_f16(blocks, 2))
    if fmt.name == "Q5_0":
        parts["qhigh"] = _tile(blocks[..., 2:6])
    if fmt.name == "Q5_1":
        parts["qhigh"] = _tile(blocks[..., 4:8])
    return {p: parts[p] for p in fmt.parts}


def _per(a: np.ndarray, weights: int) -> np.ndarray:
    """A per-`weights` part [tiles, n, 4] as float32, repeated to one value per 16 weights."""
    return np.repeat(a.astype(np.float32), weights // 16, axis=1)[..., None]


def dequantize(format_name: str, parts: dict[str, np.ndarray]) -> np.ndarray:
    """float32 [rows, cols] from repacked parts: what the kernels compute, in numpy
    (tests hold it to gguf.quants.dequantize)."""
    fmt = block_format(format_name)
    q = parts["qweight"]
    tiles, nblocks, rows_in_tile, _ = q.shape
    if fmt.name == "Q8_0":
        w = q.astype(np.float32) * parts["scale"][..., None].astype(np.float32)
    elif fmt.qweight_group == 64:  # 2-bit quants: chunk 4g + k of 64-weight group g at bits 2k
        nib = (q[:, :, None] >> (2 * np.arange(4, dtype=np.uint8))[:, None, None]) & 3
        nblocks *= 2
        w = _dequant_chunks(fmt.name, nib.reshape(tiles, nblocks * 2, rows_in_tile, 16), parts)
    else:
        # chunks of 16 weights: [tiles, cols/16, 4, 16]
        nib = np.stack([q & 15, q >> 4], axis=2).reshape(tiles, nblocks * 2, rows_in_tile, 16)
        w = _dequant_chunks(fmt.name, nib, parts)
    return w.transpose(0, 2, 1, 3).reshape(tiles * rows_in_tile, nblocks * BLOCK)


def _dequant_chunks(name: str, nib: np.ndarray, parts: dict[str, np.ndarray]) -> np.ndarray:
    """Dequantize 4-bit chunks [tiles, cols/16, 4, 16] uint8 (+ the other parts) as the kernels do."""
    if name == "Q6_K":  # the high 2 bits of chunk c are bits 2(c % 4) of qhigh's 64-weight group c // 4
        n = nib.shape[1]
        qhigh = np.repeat(parts["qhigh"], 4, axis=1)
        shift = (2 * (np.arange(n) % 4)).astype(np.uint8).reshape(1, n, 1, 1)
        q = (nib | (((qhigh >> shift) & 3) << 4)).astype(np.float32) - 32
        ds = _per(parts["scale"], 256) * _per(parts["sub_scale"], 16)  # exact: 11 x 8 bits
        return ds * q
    if name in ("IQ4_NL", "IQ4_XS"):  # 16 non-linear levels
        level = np.asarray(IQ4_VALUES, np.float32)[nib]
        if name == "IQ4_NL":
            return _per(parts["scale"], 32) * level
        return (_per(parts["scale"], 256) * _per(parts["sub_scale"], 32)) * level  # exact: 11 x 6 x 7 bits
    if name == "Q2_K":
        sub = _per(parts["sub_scale"] & 15, 16)
        mins = _per(parts["sub_scale"] >> 4, 16)
        return (_per(parts["scale"], 256) * sub) * nib.astype(np.float32) - _per(parts["min"], 256) * mins
    nib = nib.astype(np.float32)
    if "qhigh" in parts:  # Q5_0/Q5_1/Q5_K/Q3_K: chunk c's top bits are bits 16(c % 2) + j of qhigh's 32
        bits = np.unpackbits(parts["qhigh"], axis=-1, bitorder="little")  # [tiles, cols/32, 4, 32]
        high = bits.reshape(*bits.shape[:-1], 2, 16).transpose(0, 1, 3, 2, 4).reshape(nib.shape).astype(np.float32)
        if name == "Q3_K":  # the third bit
            return (_per(parts["scale"], 256) * _per(parts["sub_scale"], 16)) * (nib + 4 * high - 4)
        nib = nib + 16 * high
        if name == "Q5_0":
            return (nib - 16) * _per(parts["scale"], 32)
        if name == "Q5_1":
            return nib * _per(parts["scale"], 32) + _per(parts["min"], 32)
    if name in ("Q4_0", "Q4_1"):
        d = _per(parts["scale"], 32)
        return (nib - 8) * d if name == "Q4_0" else nib * d + _per(parts["min"], 32)
    # Q4_K, Q5_K
    ds = _per(parts["scale"], 256) * _per(parts["sub_scale"], 32)  # exact: 11 x 6 bits
    dm = _per(parts["min"], 256) * _per(parts["sub_min"], 32)
    return ds * nib - dm
