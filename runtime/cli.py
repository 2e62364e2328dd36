"""The runtime's commands: `vtool run`, `serve`, `bench` and `tokenize` (click + rich).

This module imports no compiler room (toolchain, models, schedules) and no `tvm`, so a
runtime-only install (the vtool-runtime wheel) has these commands. The full install's
`vtool` (vtool.toolchain.cli) adds build, tune, targets and dist to the same group and
registers a builder, which lets run/serve/bench compile a model on first use; without
one they take a prebuilt --artifact. Flags mirror vllm-cli / vLLM where they have a name.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Callable, Protocol

import click
from rich.console import Console

from vtool import VtoolError, __version__
from vtool.runtime.artifact.draft_state import LONE_DECODE_STEPS, MAX_FORCED, MAX_STEPS
from vtool.runtime.engine.spec_config import pair_cache_len

# No emoji codes: rich would print a completion's "arr[1:x:2]" as "arr[1❌2]" (even with markup off),
# and its 1 MiB emoji table would load on the first print (issue 16: `vtool run`'s peak memory).
console = Console(stderr=True, emoji=False)
out = Console(emoji=False)


def _fail(err: Exception) -> None:
    console.print(f"[bold red]error:[/] {err}", highlight=False)
    sys.exit(2)


class VtoolGroup(click.Group):
    """Turns VtoolError (and the target table's refusals) into one clear line and exit 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except VtoolError as err:
            _fail(err)


@click.group(cls=VtoolGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="vtool")
def main() -> None:
    """vtool: compile LLMs ahead of time with Apache TVM, then run and serve them."""


# --- the compiler, when this install has one ------------------------------------------------------

class ArtifactBuilder(Protocol):
    def __call__(self, model_path: Path, target: str, dtype: str, *, quantization: str = "auto",
                 activations: str = "auto", hf_overrides: str = "", draft_cache_len: int = 0) -> Path: ...


_builder: ArtifactBuilder | None = None


def register_builder(builder: ArtifactBuilder) -> None:
    """Called by the compiler's CLI (vtool.toolchain.cli) when it is loaded."""
    global _builder
    _builder = builder


def resolve_model(model: str | None, revision: str | None = None) -> Path:
    """--model: a local folder or .gguf file, a Hugging Face hub id (through the hub's cache),
    or the embedded default (SmolLM2-135M-Instruct Q4_1), fetched on first use."""
    if model:
        from vtool.runtime.weights.hub import resolve_model_path

        return resolve_model_path(model, revision)
    if revision:
        raise VtoolError("--revision names a revision of a hub model: give --model too")
    from rich.text import Text

    from vtool.runtime.weights.default_model import default_model_path

    # a Text, not a str: a str goes through rich's markup, which loads the emoji table (1 MiB)
    with console.status(Text("fetching the default model (SmolLM2-135M-Instruct Q4_1, 98 MB)")):
        return default_model_path()


def artifact_for(model_path: Path, artifact: str | None, target: str, dtype: str,
                 quantization: str = "auto", activations: str = "auto", hf_overrides: str | None = None,
                 draft_cache_len: int = 0) -> Path:
    """The prebuilt artifact when given (a folder, or a release archive verified and unpacked
    into the cache; nothing is compiled, so no compiler is needed), else the cached or fresh
    build when this install has the compiler. hf_overrides: --hf-overrides (a prebuilt
    artifact carries its own: given again, they must be the same)."""
    from vtool.runtime.weights.hf_overrides import parse_hf_overrides

    overrides = parse_hf_overrides(hf_overrides)  # refused by name before any build or model load
    if artifact:
        from vtool.runtime.artifact.archive import open_artifact
        from vtool.runtime.artifact.manifest import read_manifest

        folder = open_artifact(Path(artifact))
        built_with = read_manifest(folder).get("hf_overrides") or {}
        if overrides and overrides != built_with:
            raise VtoolError(f"--hf-overrides {hf_overrides} differ from those {folder} was built with "
                             f"({built_with or 'none'}): the artifact applies its own; leave the flag out or rebuild")
        return folder
    if _builder is None:
        raise VtoolError("this vtool is the runtime only (no compiler): pass --artifact with a folder made by "
                         "`vtool build` or an archive made by `vtool dist archive`")
    extra = {"draft_cache_len": draft_cache_len} if draft_cache_len else {}
    return _builder(model_path, target, dtype, quantization=quantization, activations=activations,
                    hf_overrides=hf_overrides or "", **extra)


# --- options shared with the compiler's commands ----------------------------------------------------

def artifact_option(fn: Callable) -> Callable:
    return click.option("--artifact", default=None, type=click.Path(exists=True),
                        help="run this prebuilt artifact (a folder, or a .tar.gz from `vtool dist archive`, "
                             "verified and unpacked into the cache) instead of building; a machine with only "
                             "the TVM runtime needs it; --model still names the weights")(fn)


# toolchain/build.py QUANTIZATIONS (not imported here: this module never loads the compiler)
QUANTIZATION_CHOICES = ("auto", "none", "gguf", "q4_0", "q4_1", "q8_0", "q4_k", "q6_k", "fp8")


def quantization_option(fn: Callable) -> Callable:
    return click.option(
        "--quantization", default="auto", show_default=True, type=click.Choice(QUANTIZATION_CHOICES),
        help="gguf: keep a GGUF file's Q8_0/Q4_0/Q4_1/Q5_0/Q4_K/Q6_K weights quantized in memory (CPU kernels dequantize "
             "inside the matmul; other types are dequantized at load); q4_1 (recommended), q4_0, q8_0: "
             "quantize a safetensors checkpoint's weights at build time into the artifact (GGML's 32-weight "
             "groups; q4_1 is int4 with a per-group scale and min; q4_k, q6_k: llama.cpp's K-quants); fp8: e4m3 "
             "linear weights with a float32 scale per row, quantized from a float checkpoint when it loads (on "
             "sm_89+ CUDA builds prompts and batches also quantize activations per token: W8A8 on the FP8 tensor "
             "cores); none: dequantize every weight to "
             "--dtype at load; auto: gguf for a GGUF file (on CUDA only in bf16/f16 builds whose formats are all "
             "Q4_0/Q4_1/Q4_K/Q6_K/Q8_0, which batched decode multiplies on the tensor cores; the build says "
             "why otherwise), fp8 for an FP8 checkpoint, else none")(fn)


def activations_option(fn: Callable) -> Callable:
    return click.option(
        "--activations", default="auto", show_default=True, type=click.Choice(["auto", "decode", "q8_0", "none"]),
        help="CPU, weights kept in GGUF blocks (Q8_0, Q4_0/1, Q5_0/1, K-quants, IQ4): q8_0 quantizes the "
             "activation rows of every matmul to Q8_0 (K-quants: Q8_K) blocks and multiplies integers "
             "(AVX2 / AVX-512 VNNI), as llama.cpp does (greedy text can leave float's at near-ties); decode "
             "does so in the decode matmuls only, prompts stay float32; none keeps float32 everywhere (exact); "
             "auto: q8_0 where the target has integer dot products")(fn)


def hf_overrides_option(fn: Callable) -> Callable:
    return click.option(
        "--hf-overrides", default=None,
        help='JSON object of config.json fields to use instead of the checkpoint\'s (vLLM\'s flag), e.g. '
             '\'{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}\'; '
             "each top-level field is replaced whole; the build records them and the runtime applies them")(fn)


def threads_option(fn: Callable) -> Callable:
    return click.option(
        "--threads", default=None, type=click.IntRange(min=1), envvar="VTOOL_CPU_THREADS",
        help="CPU kernels' threads (env VTOOL_CPU_THREADS; default: the physical cores this process may "
             "run on). Sets TVM_NUM_THREADS for the TVM runtime")(fn)


def structured_outputs_option(json_schema: str | None, regex: str | None, choice: str | None) -> dict | None:
    """`vtool run`'s --json-schema FILE / --regex R / --choice a,b as vLLM's structured_outputs
    fields; at most one (a UsageError names them), a schema file that is not JSON is refused."""
    given = {k: v for k, v in (("json", json_schema), ("regex", regex), ("choice", choice)) if v is not None}
    if len(given) > 1:
        raise click.UsageError("give one of --json-schema, --regex, --choice")
    if "json" in given:
        import json

        try:
            given["json"] = json.loads(Path(given["json"]).read_text())
        except ValueError as err:
            raise click.UsageError(f"--json-schema {json_schema}: not JSON ({err})") from None
    if "choice" in given:
        given["choice"] = [c for c in given["choice"].split(",")]
    return given or None


def speculative_option(fn: Callable) -> Callable:
    return click.option(
        "--speculative-config", default=None,
        help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
             '"prompt_lookup_max": 4} or {"model": DRAFT, "num_speculative_tokens": 4} (docs/USAGE.md)')(fn)


def _speculative(raw: str | None, target: str, dtype: str) -> Any:
    """The checked --speculative-config, its draft model built for the same target (refused at
    startup, naming the key, before any model loads)."""
    from vtool.runtime.engine.spec_config import parse_speculative_config
    from vtool.runtime.session import with_draft_built

    config = parse_speculative_config(raw)
    build = None if _builder is None else \
        (lambda path, draft_dtype, quantization: artifact_for(path, None, target, draft_dtype, quantization,
                                                              draft_cache_len=pair_cache_len(config)))
    return with_draft_built(config, dtype, build)


def runtime_process(threads: int | None) -> None:
    """Setup for the commands that run models: the thread count, set before the TVM runtime
    loads; and torch kept out of the process. tvm_ffi imports torch whenever it is installed
    (`import torch` in its __init__, guarded by ImportError), which costs ~200 MB of resident
    memory and seconds of start-up that running a compiled model never uses: a None entry in
    sys.modules makes that import fail fast. Only when torch is not imported already (the
    Python API inside a torch program keeps it). tvm_ffi is imported without ml_dtypes too
    (lean_ffi_import: ~8 MiB of resident memory)."""
    from vtool.runtime.artifact.tvm_runtime import apply_cpu_threads, block_torch_import, lean_ffi_import

    apply_cpu_threads(threads)
    block_torch_import()
    lean_ffi_import()


def model_options(fn: Callable) -> Callable:
    fn = click.option("--dtype", default="float32", show_default=True,
                      type=click.Choice(["float32", "float16", "bfloat16"]), help="compute dtype")(fn)
    fn = click.option("--target", default="host", show_default=True,
                      help="target name (see `vtool targets`); host = best tier this CPU runs")(fn)
    fn = click.option("--revision", default=None,
                      help="with a hub id as --model: the branch, tag or commit (default: main)")(fn)
    fn = click.option("--model", default=None,
                      help="model folder (config.json + safetensors), .gguf file or Hugging Face hub id "
                           "(org/name, from the hub's cache when offline); default: SmolLM2-135M-Instruct")(fn)
    return fn


@main.command()
@model_options
@click.option("--prompt", default="The capital of France is", show_default=True, help="prompt text")
@click.option("--tokenizer-config", default=None, help="override tokenizer_config.json")
@click.option("--max-tokens", default=16, show_default=True, type=int, help="tokens to generate (<= 0: up to the context)")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="<= 0 means greedy")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int, help="0 means all")
@click.option("--seed", default=None, type=int, help="RNG seed for sampling")
@click.option("--stream", is_flag=True, help="print tokens as they are generated")
@click.option("--repeat", default=1, show_default=True, type=click.IntRange(min=1),
              help="load once, run N times, report warm decode tok/s")
@click.option("--chat", is_flag=True, help="wrap the prompt in the model's chat template")
@click.option("--json-schema", "json_schema", default=None, type=click.Path(exists=True, dir_okay=False),
              help="the output follows this JSON schema (a .json file)")
@click.option("--regex", default=None, help="the output matches this regular expression")
@click.option("--choice", default=None, help="the output is one of these comma-separated strings")
@click.option("--max-model-len", default=None, type=int, help="context length (default: model's, capped at 4096)")
@click.option("--lone-decode", is_flag=True,
              help="a library built with --draft-cache-len: greedy decode on the library's own cache, "
                   f"{LONE_DECODE_STEPS} steps a round, each step one CUDA graph (docs/USAGE.md; not yet timed on a GPU)")
@quantization_option
@activations_option
@artifact_option
@hf_overrides_option
@threads_option
@speculative_option
def run(model: str | None, revision: str | None, target: str, dtype: str, prompt: str, tokenizer_config: str | None, max_tokens: int,
        temperature: float, top_p: float, top_k: int, seed: int | None, stream: bool, repeat: int, chat: bool,
        json_schema: str | None, regex: str | None, choice: str | None,
        max_model_len: int | None, lone_decode: bool, artifact: str | None, quantization: str, activations: str,
        hf_overrides: str | None, threads: int | None, speculative_config: str | None) -> None:
    """Generate text from a prompt (builds the model on first use)."""
    runtime_process(threads)
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.runtime.weights.hf_overrides import parse_hf_overrides
    from vtool.runtime.run_cmd import RunOptions, run_completion

    parse_hf_overrides(hf_overrides)  # bad JSON refused before the model is fetched or opened
    model_path = resolve_model(model, revision)
    checkpoint = open_checkpoint(model_path)
    spec = _speculative(speculative_config, target, dtype)
    artifact_dir = artifact_for(model_path, artifact, target, dtype, quantization, activations, hf_overrides,
                                pair_cache_len(spec))
    options = RunOptions(prompt=prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                         seed=seed, stream=stream, repeat=repeat, chat=chat, tokenizer_config=tokenizer_config,
                         max_model_len=max_model_len,
                         structured_outputs=structured_outputs_option(json_schema, regex, choice))
    from vtool.runtime.engine.engine import EngineConfig

    run_completion(artifact_dir, checkpoint, options, out, console,
                   EngineConfig(speculative=spec, lone_decode=lone_decode))


@main.command()
@model_options
@click.option("--host", default="0.0.0.0", show_default=True, help="bind address")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--served-model-name", multiple=True, help="model id(s) in /v1/models and responses (default: --model)")
@click.option("--tokenizer-config", default=None, help="override tokenizer_config.json (chat template)")
@click.option("--block-size", default=16, show_default=True, type=int, help="KV block size in tokens (16 only)")
@click.option("--num-blocks", default=None, type=click.IntRange(min=1),
              help="KV blocks (default: sized by --kv-cache-memory-bytes)")
@click.option("--kv-cache-memory-bytes", default=None, type=click.IntRange(min=1),
              help="KV-cache budget when --num-blocks is not given (default: 1 GiB on CPU; on GPU, "
                   "--gpu-memory-utilization of the memory left after the weights)")
@click.option("--gpu-memory-utilization", default=0.9, show_default=True, type=click.FloatRange(0.0, 1.0,
              min_open=True), help="GPU only: the fraction of free device memory the KV cache may take")
@click.option("--max-model-len", default=None, type=click.IntRange(min=1),
              help="context length (default: the model's, capped at 4096, fitted to the KV cache)")
@click.option("--max-num-seqs", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--max-num-batched-tokens", default=1024, show_default=True, type=click.IntRange(min=1),
              help="tokens per engine step (prefill chunks + decodes)")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True, show_default=True)
@click.option("--kv-window-freeing/--no-kv-window-freeing", default=None,
              help="a model whose every layer has a sliding window (Mistral, Phi-3-mini-4k): give back the KV "
                   "blocks the window has passed, so a sequence holds one window's blocks however long it runs "
                   "(CPU builds). Default: on where the library's kernels for it are vtool's parallel ones "
                   "(head dims of 16s); --kv-window-freeing also on TVM's serial ones (docs/USAGE.md)")
@click.option("--scheduling-policy", default="fcfs", show_default=True, type=click.Choice(["fcfs", "priority"]))
@click.option("--enable-log-requests/--disable-log-requests", default=True, show_default=True)
@click.option("--enable-log-outputs", is_flag=True)
@click.option("--max-log-len", default=256, show_default=True, type=click.IntRange(min=0))
@click.option("--disable-metrics", is_flag=True)
@click.option("--enable-force-include-usage", is_flag=True)
@click.option("--return-tokens-as-token-ids", is_flag=True,
              help='logprobs name each token "token_id:N" (a request\'s return_tokens_as_token_ids overrides)')
@click.option("--api-key", default=None, envvar="VLLM_API_KEY", help="require this Bearer key on /v1 routes")
@click.option("--reasoning-parser", default=None, type=click.Choice(["deepseek_r1", "qwen3"]),
              help="split the model's <think> section into the chat answer's `reasoning` field")
@click.option("--default-chat-template-kwargs", default=None,
              help='JSON object passed to the chat template under each request\'s own, e.g. {"enable_thinking": false}')
@click.option("--async-scheduling/--no-async-scheduling", default=True, show_default=True,
              help="GPU: build step N's outputs while the device runs step N+1")
@click.option("--api-server-count", default=1, show_default=True, type=click.IntRange(min=1),
              help="API-server processes in front of the one engine core process (they share the port)")
@click.option("--trust-remote-code", is_flag=True, help="accepted for vLLM recipes; no effect")
@click.option("--enable-auto-tool-choice", is_flag=True,
              help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser')
@click.option("--tool-call-parser", default=None,
              help="how tool calls are read from the model's text: hermes, llama3_json, mistral, pythonic, "
                   "qwen3_coder (docs/USAGE.md)")
@click.option("--structured-outputs-config", default=None,
              help='JSON object of vLLM\'s structured-outputs options: {"enable_in_reasoning": true} applies '
                   "the grammar to the reasoning section too; backend auto|guidance")
@click.option("--grammar-jump-forward/--no-grammar-jump-forward", default=True, show_default=True,
              help="structured output: append the tokens a grammar forces without a decode step each")
@click.option("--lone-decode", is_flag=True,
              help="a library built with --draft-cache-len, no speculation: a greedy request alone decodes on the "
                   "library's own cache, several steps a round, each step one CUDA graph with its attention "
                   "(docs/USAGE.md; not yet timed on a GPU)")
@click.option("--lone-decode-steps", default=LONE_DECODE_STEPS, show_default=True, type=click.IntRange(1, MAX_STEPS - MAX_FORCED + 1),
              help="tokens a lone-decode round gives (a stream receives them together)")
@quantization_option
@activations_option
@artifact_option
@hf_overrides_option
@threads_option
@speculative_option
def serve(model: str | None, revision: str | None, target: str, dtype: str, host: str, port: int, served_model_name: tuple[str, ...],
          tokenizer_config: str | None, block_size: int, num_blocks: int | None, kv_cache_memory_bytes: int | None,
          gpu_memory_utilization: float,
          max_model_len: int | None, max_num_seqs: int, max_num_batched_tokens: int, enable_prefix_caching: bool,
          kv_window_freeing: bool | None, scheduling_policy: str, enable_log_requests: bool, enable_log_outputs: bool, max_log_len: int,
          disable_metrics: bool, enable_force_include_usage: bool, return_tokens_as_token_ids: bool,
          api_key: str | None, reasoning_parser: str | None,
          default_chat_template_kwargs: str | None, async_scheduling: bool,
          api_server_count: int,
          trust_remote_code: bool,
          enable_auto_tool_choice: bool, tool_call_parser: str | None, structured_outputs_config: str | None,
          grammar_jump_forward: bool, lone_decode: bool, lone_decode_steps: int, quantization: str,
          activations: str, artifact: str | None,
          hf_overrides: str | None, threads: int | None, speculative_config: str | None) -> None:
    """Serve an OpenAI-compatible API (builds the model on first use)."""
    runtime_process(threads)
    from vtool.runtime.weights.checkpoint import open_checkpoint
    from vtool.runtime.weights.hf_overrides import parse_hf_overrides
    from vtool.runtime.engine.engine import EngineConfig
    from vtool.runtime.serving.serve_cmd import ServeOptions
    from vtool.runtime.serving.serve_cmd import serve as run_server

    for flag, on, why in (("--trust-remote-code", trust_remote_code, "vtool runs no code from checkpoints"),):
        if on:
            console.print(f"server: accepted '{flag}' for vLLM-recipe compatibility; it has no effect here: {why}",
                          highlight=False)
    engine_config = EngineConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
        num_blocks=num_blocks, kv_memory_bytes=kv_cache_memory_bytes, gpu_memory_utilization=gpu_memory_utilization,
        enable_prefix_caching=enable_prefix_caching, async_scheduling=async_scheduling,
        kv_window_freeing=kv_window_freeing,
        scheduling_policy=scheduling_policy, max_model_len=max_model_len, grammar_jump_forward=grammar_jump_forward,
        lone_decode=lone_decode, lone_decode_steps=lone_decode_steps,
        speculative=_speculative(speculative_config, target, dtype))
    opts = ServeOptions(host=host, port=port, served_model_name=served_model_name, tokenizer_config=tokenizer_config,
                        max_model_len=max_model_len, api_key=api_key, disable_metrics=disable_metrics,
                        enable_log_requests=enable_log_requests, enable_log_outputs=enable_log_outputs,
                        max_log_len=max_log_len, enable_force_include_usage=enable_force_include_usage,
                        return_tokens_as_token_ids=return_tokens_as_token_ids, api_server_count=api_server_count, reasoning_parser=reasoning_parser,
                        default_chat_template_kwargs=default_chat_template_kwargs,
                        enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                        structured_outputs_config=structured_outputs_config)
    parse_hf_overrides(hf_overrides)  # bad JSON refused before the model is fetched or opened
    model_path = resolve_model(model, revision)
    checkpoint = open_checkpoint(model_path)
    run_server(artifact_for(model_path, artifact, target, dtype, quantization, activations, hf_overrides,
                            pair_cache_len(engine_config.speculative)), checkpoint,
               engine_config, opts,
               console)


@main.command()
@click.option("--model", default=None, help="model to serve and measure (default: SmolLM2-135M-Instruct); "
                                            "with --url, the served model id (default: the first in /v1/models)")
@click.option("--revision", default=None, help="with a hub id as --model: the branch, tag or commit")
@click.option("--url", default=None, help="measure this running OpenAI server instead of starting one")
@click.option("--endpoint", default="completions", show_default=True, type=click.Choice(["completions", "chat"]))
@click.option("--dataset-path", default=None, help="ShareGPT .json, .jsonl or .txt prompts (default: synthetic)")
@click.option("--num-prompts", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--input-len", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--output-len", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--concurrency", default="1,4,8", show_default=True, help="comma list of concurrency levels")
@click.option("--max-num-batched-tokens", default=1024, show_default=True, type=click.IntRange(min=1))
@click.option("--num-blocks", default=None, type=click.IntRange(min=1))
@click.option("--max-num-seqs", default=None, type=click.IntRange(min=1),
              help="server batch limit (default: the largest --concurrency level)")
@click.option("--target", default="host", show_default=True)
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "float16", "bfloat16"]))
@click.option("--ignore-eos/--no-ignore-eos", default=True, show_default=True,
              help="generate exactly --output-len tokens per request")
@click.option("--api-key", default=None)
@click.option("--tokenizer", "tokenizer_path", default=None, type=click.Path(exists=True),
              help="the served model's tokenizer (tokenizer.json, model folder or .gguf): exact prompt lengths, "
                   "and output counted from the text when the server sends no usage; needed with --url unless "
                   "the server's /tokenize answers vLLM's shape (default without --url: the model's)")
@click.option("--seed", default=None, type=int,
              help="prompt and arrival seed (default: a fresh one per invocation, written in the report)")
@click.option("--fresh-prompts/--same-prompts", default=True, show_default=True,
              help="every concurrency level (and the warm-up) gets prompts of its own, so no prompt cache "
                   "helps one run from another; --same-prompts sends the same set at every level, as vLLM")
@click.option("--request-rate", default="inf", show_default=True,
              help="requests a second, arriving as a Poisson process (inf: all at once), as vLLM")
@click.option("--burstiness", default=1.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="gamma shape of the arrival gaps (1: Poisson; lower: burstier), as vLLM")
@click.option("--temperature", default=None, type=float,
              help="sent with every request (default: 0.0, greedy, as vLLM's bench: the server's own default "
                   "would otherwise decide what is measured)")
@click.option("--top-p", default=None, type=float, help="sent with every request when given")
@click.option("--top-k", default=None, type=int, help="sent with every request when given (-1: no limit)")
@click.option("--min-p", default=None, type=float, help="sent with every request when given")
@click.option("--extra-body", default=None,
              help="a JSON object merged into every request body, over the sampling flags, e.g. '{\"top_k\": 20}'")
@click.option("--metric-percentiles", default="50,90,99", show_default=True,
              help="comma list of the TTFT/TPOT/ITL/E2EL percentiles to report")
@click.option("--goodput", multiple=True,
              help="KEY:MS service-level objectives (ttft, tpot, e2el) for the goodput figure, as vLLM; repeatable")
@click.option("--save-detailed", is_flag=True, help="add per-request lists (latencies, texts) to --result-json")
@click.option("--result-json", default=None, help="write the report here as JSON")
@click.option("--client-processes", default=None, type=click.IntRange(min=1),
              help="processes that read the streams (default: 1 below 32 concurrent requests, else one per 16, "
                   "at most half the cores and 8): one event loop cannot keep up with many fast streams")
@quantization_option
@activations_option
@artifact_option
@hf_overrides_option
@threads_option
@speculative_option
def bench(model: str | None, revision: str | None, url: str | None, endpoint: str, dataset_path: str | None, num_prompts: int,
          input_len: int, output_len: int, concurrency: str, max_num_batched_tokens: int, num_blocks: int | None,
          max_num_seqs: int | None, target: str, dtype: str, ignore_eos: bool, api_key: str | None,
          tokenizer_path: str | None, seed: int | None, fresh_prompts: bool, request_rate: str, burstiness: float,
          temperature: float | None, top_p: float | None, top_k: int | None, min_p: float | None,
          extra_body: str | None, metric_percentiles: str, goodput: tuple[str, ...], save_detailed: bool,
          result_json: str | None, client_processes: int | None, quantization: str, activations: str,
          artifact: str | None,
          hf_overrides: str | None, threads: int | None, speculative_config: str | None) -> None:
    """Measure serving throughput and latency (TTFT, TPOT, ITL, E2EL) as vLLM defines them.
    --threads applies to the local server it starts (passed on as VTOOL_CPU_THREADS); --quantization,
    --activations and --hf-overrides to the build it serves (the artifact carries them to the server)."""
    if url and (artifact or hf_overrides or quantization != "auto" or activations != "auto"):
        raise click.UsageError("--artifact, --hf-overrides, --quantization and --activations build or pick the "
                               "local server's model; with --url the server is already running")
    if threads is not None:
        from vtool.runtime.artifact.tvm_runtime import apply_cpu_threads

        apply_cpu_threads(threads)  # the local server process inherits VTOOL_CPU_THREADS
    from vtool.runtime.bench.command import (BenchOptions, bench_main, parse_concurrency, parse_extra_body,
                                             parse_goodput, parse_percentiles, parse_request_rate)
    from vtool.runtime.bench.local_server import local_server

    levels = parse_concurrency(concurrency)
    opts = BenchOptions(model=model if url else None, url=url or "", endpoint=endpoint, dataset_path=dataset_path,
                        num_prompts=num_prompts, input_len=input_len, output_len=output_len, concurrency=levels,
                        request_rate=parse_request_rate(request_rate), burstiness=burstiness,
                        ignore_eos=ignore_eos, api_key=api_key, seed=seed, result_json=result_json,
                        tokenizer=tokenizer_path, fresh_prompts=fresh_prompts, temperature=temperature,
                        top_p=top_p, top_k=top_k, min_p=min_p, extra_body=parse_extra_body(extra_body),
                        percentiles=parse_percentiles(metric_percentiles), goodput=parse_goodput(goodput),
                        save_detailed=save_detailed, client_processes=client_processes)
    opts.request_body()  # bad sampling flags refused before any server starts
    if url:
        bench_main(opts, None, out)
        return
    model_path = resolve_model(model, revision)
    # checked, and the draft built, before the server starts; then the target, with progress
    spec = _speculative(speculative_config, target, dtype) if speculative_config is not None else None
    artifact_dir = artifact_for(model_path, artifact, target, dtype, quantization, activations, hf_overrides,
                                pair_cache_len(spec))
    limited = [x for x in levels if x > 0]
    seqs = max_num_seqs or (max(limited) if limited else 32)
    with local_server(model_path, artifact_dir, max_num_seqs=seqs, max_num_batched_tokens=max_num_batched_tokens,
                      num_blocks=num_blocks, console=console,
                      extra_args=["--speculative-config", speculative_config] if speculative_config else []
                      ) as (server_url, tokenizer):
        bench_main(dataclasses.replace(opts, url=server_url), tokenizer, out)



@main.command()
@click.argument("tokenizer", type=click.Path(exists=True, dir_okay=True))
@click.argument("corpus", type=click.Path(exists=True, dir_okay=False))
def tokenize(tokenizer: str, corpus: str) -> None:
    """Tokenize CORPUS with TOKENIZER (tokenizer.json, a model folder, or model.gguf): counts and ids."""
    from vtool.runtime.text.tokenize_cmd import run_tokenize

    sys.exit(run_tokenize(tokenizer, corpus, out))


if __name__ == "__main__":
    main()
