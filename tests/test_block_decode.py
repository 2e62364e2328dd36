"""Which decode steps take the prompt path (runtime/engine/block_decode.py), read from a
library's manifest: only CUDA libraries whose weights stay in blocks and that hold
batch_verify; VTOOL_BLOCK_GEMV_ROWS moves the threshold or turns it off, and a value that is
not an integer is refused by name."""
from __future__ import annotations

import types

import pytest
from hypothesis import given, strategies as st

from vtool.runtime.engine.block_decode import GEMV_MAX_ROWS, ROWS_ENV, prompt_path_rows

ENTRIES = ["embed", "prefill", "decode", "batch_prefill", "batch_decode", "batch_verify"]


def _library(family: str = "cuda", kept: dict | None = None, entries: list[str] = ENTRIES):  # noqa: ANN202
    return types.SimpleNamespace(manifest={
        "target": {"family": family}, "entry_points": entries,
        "quantized_weights": {"dequantized": {}, "kept": {"Q4_1": 130} if kept is None else kept}})


def test_kept_blocks_on_cuda_take_the_prompt_path_past_the_gemvs_rows(monkeypatch) -> None:
    monkeypatch.delenv(ROWS_ENV, raising=False)
    assert prompt_path_rows(_library()) == GEMV_MAX_ROWS


@pytest.mark.parametrize("library", [_library(family="x86"), _library(kept={}),
                                     _library(entries=ENTRIES[:-1]), types.SimpleNamespace(manifest={})])
def test_other_libraries_keep_every_decode_step(monkeypatch, library) -> None:  # noqa: ANN001
    monkeypatch.delenv(ROWS_ENV, raising=False)
    assert prompt_path_rows(library) is None


@given(st.integers(-5, 300))
def test_the_variable_sets_the_rows_and_a_negative_turns_it_off(rows: int) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ROWS_ENV, str(rows))
        assert prompt_path_rows(_library()) == (None if rows < 0 else rows)


@pytest.mark.parametrize("raw", ["eight", "8.5", "1e3"])
def test_a_value_that_is_not_an_integer_is_refused_by_name(monkeypatch, raw: str) -> None:
    monkeypatch.setenv(ROWS_ENV, raw)
    with pytest.raises(ValueError, match=ROWS_ENV):
        prompt_path_rows(_library())


def test_a_library_multiplying_every_kept_format_on_tensor_cores_keeps_batch_decode(monkeypatch) -> None:
    monkeypatch.delenv(ROWS_ENV, raising=False)
    library = _library(kept={"Q4_1": 128, "Q8_0": 1})
    library.manifest["quantized_weights"]["batched_decode_mma"] = ["Q4_1", "Q8_0"]
    assert prompt_path_rows(library) is None
    library.manifest["quantized_weights"]["kept"]["Q6_K"] = 2  # a format left to the GEMV: its rows grow
    assert prompt_path_rows(library) == GEMV_MAX_ROWS
    monkeypatch.setenv(ROWS_ENV, "0")  # the variable still decides when set
    library.manifest["quantized_weights"]["kept"].pop("Q6_K")
    assert prompt_path_rows(library) == 0


def test_a_lone_sequence_takes_decode_only_where_batches_run_on_tensor_cores() -> None:
    from vtool.runtime.engine.block_decode import tensor_core_batches

    library = _library()
    assert not tensor_core_batches(library) and not tensor_core_batches(types.SimpleNamespace())
    library.manifest["quantized_weights"]["batched_decode_mma"] = ["Q4_1"]
    assert tensor_core_batches(library)
