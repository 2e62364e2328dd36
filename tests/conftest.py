"""Shared test setup.

- The helper modules live in tests/support/ (tiny_models, hf_oracle, assets, quant_gguf, ...);
  both tests/ and tests/support/ are put on sys.path, so tests import them as top-level
  modules: `from tiny_models import make_tiny_model`.
- Markers (registered in setup.cfg, --strict-markers): `gpu` tests need an NVIDIA GPU and are
  skipped here, with the reason, when none is usable; `slow` tests build real models or run
  many compiles. The quick loop is `pytest -m "not slow"` (tests/README.md).
- Session fixtures for the tiny chat model -> artifact -> session chain, built once per run.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Tests never reach a model hub: everything they use is built here or fetched from PyPI/npm.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# -- parallel workers (pytest-xdist: setup.cfg runs `-n auto --dist loadfile`) --------------------

def _usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per core this process may use, at most 4 (the tests' own servers
    and builds want cores too) and one per 5 GiB of available memory (a worker holding torch,
    TVM's compiler and a real model peaks near 3 GiB)."""
    import psutil

    cores = _usable_cores()
    by_memory = psutil.virtual_memory().available // (5 << 30)
    return max(1, min(cores, 4, by_memory))


def _share_the_cores_between_workers() -> None:
    """In a worker: its share of the cores for TVM's thread pool (and, through VTOOL_CPU_THREADS,
    the servers and runs it starts) and for torch. TVM's pool spins while it waits for work,
    so two workers each running a pool as wide as the machine slow each other down many times."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or os.environ.get("VTOOL_CPU_THREADS"):
        return
    share = str(max(1, _usable_cores() // workers))
    for name in ("VTOOL_CPU_THREADS", "TVM_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = share


_share_the_cores_between_workers()  # before anything loads TVM's runtime or torch

TESTS = Path(__file__).resolve().parent
SUPPORT = TESTS / "support"
for _path in (str(TESTS), str(SUPPORT)):  # support first: sys.path[0]
    if _path not in sys.path:
        sys.path.insert(0, _path)


# -- the `gpu` marker ------------------------------------------------------------------------

# In a child process: a process that initialised CUDA must not fork workers that touch it, and
# the tests' own probes (torch, the vtool runtime) then start from a clean process.
_GPU_PROBE = r"""
import ctypes, sys
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as e:
    sys.exit(f"no NVIDIA driver: libcuda.so.1 does not load ({e})")
if cuda.cuInit(0) != 0:
    sys.exit("the NVIDIA driver loads but cuInit fails (no device, or the driver is unusable)")
count = ctypes.c_int(0)
if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
    sys.exit("the NVIDIA driver sees no GPU")
"""


@functools.lru_cache(maxsize=1)
def gpu_missing() -> str:
    """'' where an NVIDIA GPU is usable, else why not."""
    try:
        done = subprocess.run([sys.executable, "-c", _GPU_PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the GPU probe did not finish: {e}"
    if done.returncode == 0:
        return ""
    return (done.stderr.strip().splitlines() or [f"the GPU probe exited {done.returncode}"])[-1]


# The files that take minutes on a fresh machine, longest first (cold-cache worker seconds on 2
# cores, session 53: the per-format tiny builds, the 13 CUDA builds, the llama-server build, ...).
# The workers take whole files in collection order (setup.cfg: --no-loadscope-reorder; xdist's
# default order, most tests first, left the 4-test llama-server file with its ~5-minute build for
# the end, beside an idle worker), so these go first and the many short files fill the end.
LONGEST_FILES_FIRST = (
    "test_quant_gguf.py", "test_cuda_build.py", "test_bench_llama_server.py", "test_gemma.py",
    "test_parity_tiny.py", "test_cpu_half_parity.py", "test_int8_gemv.py", "test_gpu_block_mma.py",
    "test_draft_chain.py", "test_gpu_quantized.py", "test_kquant_gemm.py", "test_aarch64.py",
    "test_quantize_safetensors.py", "test_tune_records.py",
)


@pytest.hookimpl(trylast=True)  # after `-m` has deselected: no probe when no gpu test is left
def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = gpu_missing()
    if reason:
        skip = pytest.mark.skip(reason=f"needs an NVIDIA GPU: {reason}")
        for item in gpu_items:
            item.add_marker(skip)


# -- tiny chat model -> artifact -> session, once per run -----------------------------------

@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """tiny_models.make_tiny_chat_model: a 2-layer random Llama (hidden 64) with SmolLM2's real
    tokenizer and chat template. Shared by every test of the run: never write into it (copy it)."""
    from tiny_models import make_tiny_chat_model
    from vtool.runtime.weights.default_model import default_model_path

    return make_tiny_chat_model(tmp_path_factory.mktemp("tinychat"), default_model_path())


@pytest.fixture(scope="session")
def tiny_artifact(tiny_model_dir) -> Path:
    """The host (float32) build of tiny_model_dir, from the artifact cache when it is there."""
    from vtool.toolchain.build import build_artifact

    return build_artifact(tiny_model_dir, "host")


@pytest.fixture(scope="session")
def tiny_session(tiny_model_dir, tiny_artifact):
    """open_session on tiny_artifact, max_model_len 256. Shared: tests make their own Engine
    (tiny_engine) and leave the session's generator as they found it."""
    from vtool.runtime.session import open_session
    from vtool.runtime.weights.checkpoint import open_checkpoint

    return open_session(tiny_artifact, open_checkpoint(tiny_model_dir), max_model_len=256)


@pytest.fixture
def tiny_engine(tiny_session):
    """A factory: tiny_engine(**EngineConfig fields) -> a new Engine on tiny_session."""
    from vtool.runtime.engine.engine import Engine, EngineConfig

    def make(**config) -> Engine:
        return Engine(tiny_session, EngineConfig(**config))

    return make


@pytest.fixture(scope="session")
def tiny_shape_dir(tmp_path_factory):
    """A factory: tiny_shape_dir(name) -> the folder of tiny_models.make_tiny_model(name) (seed 0),
    made once per run for each TINY_SHAPES name. Shared: never write into it (copy it)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            from tiny_models import make_tiny_model

            made[name] = make_tiny_model(name, tmp_path_factory.mktemp(f"tiny-{name}"))
        return made[name]

    return get
