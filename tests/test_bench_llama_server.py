"""`vtool bench --url` against a real llama.cpp `llama-server` (issue #13 item 8).

llama-server is built from the llama.cpp tree vendored in the llama-cpp-python sdist
(tests/bench/llamacpp.py, build_llama_server): the benchmarks' release build when it is already
there, else the "quick" flavour (C++ at -O0, ggml's kernels at -O2: the protocol and the token
accounting are the same, only slower; a few minutes on 2 cores the first time, then cached). It serves the default model (SmolLM2-135M
Q4_1 GGUF) with `-np 2 --metrics` and one thread: ggml's threads wait for each other spinning, so
two of them on a CI machine whose other cores run another test worker took minutes for what one
thread serves in seconds (measured: 155 s against 4 s for the completions case beside two busy
processes on 2 cores). The bench reads the tokenizer from the same GGUF.

What is checked, against the server's own accounting:
* every prompt is exactly --input-len tokens on the server: completions usage.prompt_tokens ==
  input_len (this GGUF says add_bos_token = false, so no BOS is added); chat usage.prompt_tokens
  == the chat template around the prompt, as the local tokenizer renders and counts it
  (input_len + 30 here: SmolLM2's template adds a system turn and the role markers);
* every request's output tokens are the server's usage (llama-server puts it in the finish
  chunk of /v1/completions, and in a chunk of its own on chat), --output-len each (ignore_eos);
* the bench's totals equal the server's Prometheus counters over the same time: prompt tokens
  (processed + reused from the cache) and predicted tokens; and fresh prompts: no prompt token
  is reused from llama-server's prompt cache between runs on /v1/completions;
* without usage (chat with include_usage off) the output is counted by re-tokenizing the text,
  and the report says so;
* without --tokenizer the synthetic dataset is refused, because llama-server's /tokenize takes
  {"content": ...} and answers vLLM's {"prompt": ...} with {"tokens": []}.
Before the fix the bench trusted that /tokenize (prompts of ~11x --input-len words) and
counted one output token per request (it read usage only from chunks without choices).
"""
from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path

import pytest
from rich.console import Console

from vtool import VtoolError
from vtool.runtime.bench.command import BenchOptions, BenchPrompt, bench_main, run_bench

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))

pytestmark = pytest.mark.slow

INPUT_LEN, OUTPUT_LEN, N_PROMPTS = 16, 8, 4  # short prompts: the quick build runs its C++ at -O0
LEVELS = [1, 2]


def _need_build_tools() -> None:
    import llamacpp

    missing = ([] if shutil.which("cmake") else ["cmake"]) + llamacpp.build_tools_missing()
    if missing and not any(llamacpp.llama_server_built(flavor=f) for f in llamacpp.SERVER_FLAVORS):
        pytest.skip(f"building llama-server needs {', '.join(missing)}, which this machine lacks")


@pytest.fixture(scope="module")
def llama():
    _need_build_tools()
    import llamacpp

    from vtool.runtime.weights.default_model import default_model_path

    model = default_model_path()
    # the release build when a benchmark made it; else the quick one (a fresh machine, CI)
    flavor = "release" if llamacpp.llama_server_built(flavor="release") else "quick"
    binary = llamacpp.build_llama_server(flavor=flavor)
    with llamacpp.llama_server(model, parallel=2, threads=1, ctx_size=2 * 512, binary=binary) as srv:
        yield srv, model, llamacpp


def _counters(llamacpp, url: str) -> tuple[float, float]:
    m = llamacpp.server_metrics(url)
    return m["prompt_tokens_total"] + m["prompt_tokens_cached_total"], m["tokens_predicted_total"]


def _bench(url: str, model: Path, endpoint: str, tmp_path: Path, **kw) -> dict:
    opts = BenchOptions(url=url, endpoint=endpoint, num_prompts=N_PROMPTS, input_len=INPUT_LEN,
                        output_len=OUTPUT_LEN, concurrency=LEVELS, ignore_eos=True, save_detailed=True,
                        tokenizer=str(model), result_json=str(tmp_path / f"{endpoint}.json"), **kw)
    return bench_main(opts, console=Console(file=io.StringIO(), width=150))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_counts_what_llama_server_counts(llama, endpoint, tmp_path):
    srv, model, llamacpp = llama
    prompt_before, predicted_before = _counters(llamacpp, srv["url"])
    report = _bench(srv["url"], model, endpoint, tmp_path, warmup=False, seed=7)
    prompt_after, predicted_after = _counters(llamacpp, srv["url"])

    assert report["fresh_prompts"] is True and report["seed"] == 7
    assert report["tokenizer"] == str(model)
    template = 0
    if endpoint == "chat":
        from vtool.runtime.text.tokenizer import Tokenizer

        tok = Tokenizer.load(model)
        template = len(tok.encode(tok.apply_chat_template([{"role": "user", "content": "x"}]), False)) - 1
        assert template == 30
    for run in report["runs"]:
        assert (run["completed"], run["failed"]) == (N_PROMPTS, 0), run["failed_errors"]
        # prompt: exactly --input-len tokens on the server (plus the chat template on chat)
        assert run["usage_prompt_tokens"] == [INPUT_LEN + template] * N_PROMPTS
        check = run["prompt_tokens_check"]
        assert check["mismatched_requests"] == 0, check
        assert check["requested_total"] == N_PROMPTS * INPUT_LEN
        assert check["expected_total"] == check["server_total"] == N_PROMPTS * (INPUT_LEN + template)
        # output: the server's usage, --output-len each
        assert run["output_tokens_counted_by"] == {"usage": N_PROMPTS}
        assert run["usage_completion_tokens"] == run["output_lens"] == [OUTPUT_LEN] * N_PROMPTS
        assert run["total_output_tokens"] == N_PROMPTS * OUTPUT_LEN
        assert run["total_input_tokens"] == sum(run["usage_prompt_tokens"])
        # a chunk per token (chat: and the role chunk first), and the finish chunk adds no gap; a token
        # ending inside a UTF-8 character is held back and sent with the next, so a reply of emoji or
        # Hebrew has fewer chunks (seen under load: 4 emoji from 12 tokens came as 4 chunks), never
        # more than one per character; an all-ASCII reply has exactly one per token
        role = int(endpoint == "chat")
        for itl, text in zip(run["itls"], run["generated_texts"]):
            chunks = len(itl) + 1 - role
            assert 1 <= chunks <= min(OUTPUT_LEN, len(text)), (chunks, text)
            if text.isascii():
                assert chunks == OUTPUT_LEN, (chunks, text)
        assert run["mean_tpot_ms"] > 0 and run["mean_ttft_ms"] > 0
        if endpoint == "completions":   # fresh prompts: nothing for llama-server's prompt cache to reuse
            assert run["cached_prompt_tokens"] == 0
    # the bench's totals are the server's own counters over the same requests (no warm-up here)
    assert sum(r["total_input_tokens"] for r in report["runs"]) == prompt_after - prompt_before
    assert sum(r["total_output_tokens"] for r in report["runs"]) == predicted_after - predicted_before


def test_without_usage_the_text_is_counted(llama):
    srv, model, _ = llama
    from vtool.runtime.text.tokenizer import Tokenizer

    tok = Tokenizer.load(model)
    prompts = [BenchPrompt(f"Tell me a story about the number {i}.", 0) for i in range(2)]
    report = run_bench(srv["url"], None, prompts, OUTPUT_LEN, [2], "chat", console=Console(file=io.StringIO()),
                       ignore_eos=True, warmup=False, save_detailed=True,
                       count_tokens=lambda s: len(tok.encode(s, add_special_tokens=False)),
                       extra_body={"stream_options": {"include_usage": False}})
    run = report["runs"][0]
    assert run["completed"] == 2 and run["usage_completion_tokens"] == [None, None]
    assert run["output_tokens_counted_by"] == {"tokenizer": 2}
    assert report["output_token_fallback"] == "tokenizer"
    # OUTPUT_LEN tokens generated; detokenized and re-tokenized they come out within a token or two
    for text, n in zip(run["generated_texts"], run["output_lens"]):
        assert n == len(tok.encode(text, add_special_tokens=False)) and abs(n - OUTPUT_LEN) <= 2, (text, n)


def test_without_tokenizer_synthetic_prompts_are_refused(llama):
    srv, _, _ = llama
    opts = BenchOptions(url=srv["url"], num_prompts=2, input_len=INPUT_LEN, output_len=4, concurrency=[1])
    with pytest.raises(VtoolError, match="--tokenizer") as e:
        bench_main(opts, console=Console(file=io.StringIO()))
    assert "vLLM's shape" in str(e.value)
