"""Release files (toolchain/dist.py, runtime/artifact/archive.py): an artifact archive round
trip, the refusal of damaged or tampered archives by file, and the vtool-runtime wheel in a
fresh virtualenv (no apache-tvm, torch or transformers) matching transformers greedy."""
from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import io
import json
import os
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vtool.runtime.artifact.archive import (PROVENANCE_NAME, SUMS_NAME, ArchiveError, archive_cache, open_artifact,
                                            verify_archive)
from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.toolchain.build import build_artifact
from vtool.toolchain.dist import build_runtime_wheel, write_archive
from vtool.toolchain.provenance import checkpoint_record

PROMPT = "Hello there, how"
STEPS = 8


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> Path:
    return tiny_model_dir  # conftest's tiny chat model (read only)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, tiny) -> Path:
    """A private vtool cache for unpacked archives (after `tiny`: the default model stays in the user's)."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("cache")
        mp.setenv("VTOOL_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny) -> Path:
    """Built here, not taken from the cache: its provenance must name exactly this checkpoint."""
    return build_artifact(tiny, "host", output=tmp_path_factory.mktemp("build") / "artifact")


@pytest.fixture(scope="module")
def archive(tmp_path_factory, artifact) -> Path:
    return write_archive(artifact, tmp_path_factory.mktemp("archive") / "artifact.tar.gz").path


@pytest.fixture(scope="module")
def members(archive) -> list[tuple[str, bytes]]:
    with tarfile.open(archive) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]


def pack(members: list[tuple[str, bytes]], path: Path) -> Path:
    """Re-pack plain-file members in memory (fast: gzip level 1)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    return path


def with_sums(members: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """The members with SHA256SUMS recomputed, as a careful tamperer would."""
    files = [(n, d) for n, d in members if n != SUMS_NAME]
    sums = "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in sorted(files)).encode()
    return [(SUMS_NAME, sums)] + files


def engine_tokens(folder: Path, checkpoint_dir: Path) -> list[int]:
    from vtool.runtime.engine.engine import Engine
    from vtool.runtime.sampling.params import SamplingParams
    from vtool.runtime.session import open_session

    session = open_session(folder, open_checkpoint(checkpoint_dir), max_model_len=128)
    engine = Engine(session)
    engine.add_request("r", session.encode_prompt(PROMPT), SamplingParams(temperature=0, max_tokens=STEPS,
                                                                           ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def refused(path: Path, *names: str) -> None:
    """verify_archive and open_artifact both refuse `path`, naming one of `names`; nothing is
    left in the cache."""
    for check in (verify_archive, open_artifact):
        with pytest.raises(ArchiveError) as err:
            check(path)
        assert any(n in str(err.value) for n in names), (check.__name__, names, str(err.value))
    left = [p.name for p in archive_cache().iterdir()] if archive_cache().exists() else []
    assert all(name != hashlib.sha256(path.read_bytes()).hexdigest()[:32] and not name.startswith(".unpack-")
               for name in left), left


# ---- (a) the round trip --------------------------------------------------------------------

def test_archive_round_trip_runs_the_same_tokens(tiny, artifact, archive, cache_dir):
    info = verify_archive(archive)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert sorted(info.files) == ["manifest.json", "model.so", PROVENANCE_NAME]
    assert info.sha256 == hashlib.sha256(archive.read_bytes()).hexdigest()
    prov = info.provenance
    assert prov["target"] == manifest["target"] and prov["target"]["features"]
    assert prov["versions"] == manifest["versions"] and prov["versions"]["tvm"]
    assert prov["checkpoint"]["sha256"] == checkpoint_record(open_checkpoint(tiny))["sha256"]
    assert prov["options"]["requested"]["target"] == "host"
    assert prov["options"]["resolved"]["target"] == manifest["target"]["name"]
    assert prov["build_host"]["hostname"] and prov["build_host"]["cpu"] and prov["built_at"]

    assert open_artifact(artifact) == artifact  # a folder is taken as it is
    unpacked = open_artifact(archive)
    assert unpacked.parent == cache_dir / "archives" and unpacked.name == info.sha256[:32]
    inode = (unpacked / "model.so").stat().st_ino
    assert open_artifact(archive) == unpacked and (unpacked / "model.so").stat().st_ino == inode  # reused
    done = subprocess.run(["sha256sum", "--check", "--strict", SUMS_NAME], cwd=unpacked, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr  # coreutils reads the same SHA256SUMS

    with open(unpacked / "model.so", "ab") as f:  # a damaged copy in the cache is unpacked again
        f.write(b"\0")
    assert open_artifact(archive) == unpacked
    assert (unpacked / "model.so").read_bytes() == (artifact / "model.so").read_bytes()

    assert engine_tokens(unpacked, tiny) == engine_tokens(artifact, tiny)


def test_the_cli_verifies_and_refuses_by_file(archive, members, tmp_path):
    cli = [sys.executable, "-m", "vtool.toolchain.cli", "dist", "verify"]
    good = subprocess.run(cli + [str(archive)], capture_output=True, text=True, timeout=120)
    assert good.returncode == 0 and "verified" in good.stdout, good.stdout + good.stderr
    bad = [(n, d + b"\0" if n == "model.so" else d) for n, d in members]
    done = subprocess.run(cli + [str(pack(bad, tmp_path / "bad.tar.gz"))], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "model.so does not match SHA256SUMS" in done.stderr, done.stdout + done.stderr


# ---- (b) refusals ------------------------------------------------------------------------

@st.composite
def tamperings(draw, members: list[tuple[str, bytes]]):
    """(members after one change, the file a refusal must name)."""
    names = [n for n, _ in members]
    kind = draw(st.sampled_from(["flip", "flip", "add", "remove"]))
    if kind == "add":
        name = draw(st.sampled_from(["extra.bin", "notes.txt", "lib/other.so", "manifest.json.bak"]))
        data = draw(st.binary(max_size=64))
        return members + [(name, data)], name
    name = draw(st.sampled_from(names))
    if kind == "remove":
        return [(n, d) for n, d in members if n != name], name
    data = dict(members)[name]
    pos = draw(st.integers(0, len(data) - 1))
    xor = draw(st.integers(1, 255))
    changed = data[:pos] + bytes([data[pos] ^ xor]) + data[pos + 1:]
    return [(n, changed if n == name else d) for n, d in members], name


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_changed_added_or_removed_file_is_refused_by_name(members, cache_dir, tmp_path_factory, data):
    tampered, name = data.draw(tamperings(members))
    path = pack(tampered, tmp_path_factory.mktemp("tampered") / "artifact.tar.gz")
    refused(path, name)


def test_the_untouched_repack_passes(members, cache_dir, tmp_path):
    """The control for the refusals: re-packing alone changes nothing."""
    path = pack(members, tmp_path / "same.tar.gz")
    assert verify_archive(path).files and (open_artifact(path) / "model.so").exists()


def _special(kind: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo("model.so")
    if kind == "symlink":
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
    elif kind == "hardlink":
        info.type, info.linkname = tarfile.LNKTYPE, "manifest.json"
    elif kind == "folder":
        info.name, info.type = "lib", tarfile.DIRTYPE
    elif kind == "fifo":
        info.type = tarfile.FIFOTYPE
    return info


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "folder", "fifo"])
def test_links_folders_and_devices_are_refused(members, cache_dir, tmp_path, kind):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members:
            if name != "model.so":
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        tar.addfile(_special(kind))
    path = tmp_path / "special.tar.gz"
    path.write_bytes(buf.getvalue())
    refused(path, "'lib'" if kind == "folder" else "'model.so'")


@pytest.mark.parametrize("name", ["/tmp/evil", "../evil", "lib/../../evil", "./model.so", "a//b"])
def test_absolute_and_climbing_paths_are_refused(members, cache_dir, tmp_path, name):
    refused(pack(with_sums(members) + [(name, b"x")], tmp_path / "path.tar.gz"), repr(name))


def test_a_file_twice_is_refused(members, cache_dir, tmp_path):
    data = dict(members)
    refused(pack(members + [("model.so", data["model.so"])], tmp_path / "twice.tar.gz"), "'model.so' appears twice")


def test_provenance_must_agree_with_the_manifest(members, cache_dir, tmp_path):
    """Sums recomputed after the change, so only the manifest/provenance checks can refuse."""
    data = dict(members)
    prov = json.loads(data[PROVENANCE_NAME])
    prov["target"]["name"] = "x86-portable"
    edited = [(n, json.dumps(prov).encode() if n == PROVENANCE_NAME else d) for n, d in members]
    refused(pack(with_sums(edited), tmp_path / "prov.tar.gz"), f"{PROVENANCE_NAME} disagrees with manifest.json on 'target'")

    manifest = json.loads(data["manifest.json"])
    manifest["dtype"] = "float16"
    edited = [(n, json.dumps(manifest).encode() if n == "manifest.json" else d) for n, d in members]
    refused(pack(with_sums(edited), tmp_path / "manifest.tar.gz"), "'manifest_sha256'")

    manifest = json.loads(data["manifest.json"])
    manifest["library"] = "other.so"
    text = json.dumps(manifest).encode()
    prov = json.loads(data[PROVENANCE_NAME])
    prov["manifest_sha256"] = hashlib.sha256(text).hexdigest()
    edited = [(n, text if n == "manifest.json" else json.dumps(prov).encode() if n == PROVENANCE_NAME else d)
              for n, d in members]
    refused(pack(with_sums(edited), tmp_path / "library.tar.gz"), "names the library 'other.so'")


def test_a_truncated_or_foreign_file_is_refused(archive, cache_dir, tmp_path):
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    refused(cut, str(cut))
    other = tmp_path / "artifact.zip"
    other.write_bytes(b"PK")
    with pytest.raises(ArchiveError, match="artifact.zip"):
        open_artifact(other)


# ---- (c) the runtime wheel -----------------------------------------------------------------

PROBE = r"""
import json, sys
from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.runtime.engine.engine import Engine
from vtool.runtime.sampling.params import SamplingParams
from vtool.runtime.session import open_session
from vtool.runtime.artifact.archive import open_artifact
session = open_session(open_artifact(sys.argv[1]), open_checkpoint(sys.argv[2]), max_model_len=128)
engine = Engine(session)
prompt = session.encode_prompt(sys.argv[3])
engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=int(sys.argv[4]), ignore_eos=True))
tokens = []
while engine.has_unfinished():
    for out in engine.step():
        tokens += out.new_token_ids
maps = [line.split()[-1] for line in open("/proc/self/maps") if "libtvm" in line]
from vtool.runtime.artifact.library import installed_versions
print(json.dumps({"prompt": prompt, "tokens": tokens, "libraries": sorted(set(maps)), "versions": installed_versions()}))
"""


def _record_ok(zf: zipfile.ZipFile) -> None:
    """Every RECORD line's sha256 and size match the wheel's member (PEP 376/427)."""
    record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
    for line in zf.read(record).decode().splitlines():
        name, digest, size = line.rsplit(",", 2)
        if name == record:
            continue
        data = zf.read(name)
        want = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert (digest, int(size)) == (want, len(data)), name
    assert sorted(line.rsplit(",", 2)[0] for line in zf.read(record).decode().splitlines()) == sorted(zf.namelist())


def _du_mb(folder: Path) -> float:
    """Disk usage as `du -sk` counts it (blocks, links once), in MB."""
    return int(subprocess.run(["du", "-sk", str(folder)], capture_output=True, text=True, check=True)
               .stdout.split()[0]) * 1024 / 1e6


@pytest.mark.slow
def test_runtime_wheel_in_a_fresh_venv_matches_transformers(tiny, artifact, archive, tmp_path):
    import transformers
    from hf_oracle import greedy

    wheel = build_runtime_wheel(tmp_path / "wheel")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        _record_ok(zf)
    assert "vtool/runtime/artifact/lib/libtvm_runtime.so" in names and "vtool/runtime/artifact/lib/LICENSE" in names
    assert not [n for n in names if "libtvm_compiler" in n or n.startswith(("vtool/toolchain", "vtool/models",
                                                                             "vtool/schedules"))]

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VTOOL_CACHE_DIR=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    check = ("import importlib.metadata as m, json\n"
             "def v(d):\n  try: return m.version(d)\n  except m.PackageNotFoundError: return None\n"
             "print(json.dumps({d: v(d) for d in ('apache-tvm', 'torch', 'transformers', 'vtool', 'vtool-runtime')}))")
    installed = json.loads(subprocess.run([str(python), "-c", check], capture_output=True, text=True, env=env,
                                          cwd=tmp_path, check=True).stdout)
    assert installed == {"apache-tvm": None, "torch": None, "transformers": None, "vtool": None,
                         "vtool-runtime": installed["vtool-runtime"]} and installed["vtool-runtime"]
    assert not list(venv.rglob("libtvm_compiler*"))
    print(f"\nfresh vtool-runtime venv: {_du_mb(venv):.0f} MB on disk (du -sk; {wheel.name}, "
          f"{wheel.stat().st_size / 1e6:.1f} MB)")

    probe = subprocess.run([str(python), "-c", PROBE, str(archive), str(tiny), PROMPT, str(STEPS)],
                           capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr[-3000:]
    report = json.loads(probe.stdout.strip().splitlines()[-1])
    runtime = [lib for lib in report["libraries"] if lib.endswith("/libtvm_runtime.so")]
    assert runtime and all("/vtool/runtime/artifact/lib/" in lib for lib in runtime), report["libraries"]
    assert not [lib for lib in report["libraries"] if "libtvm_compiler" in lib]
    # Without apache-tvm the runtime still knows which TVM its libraries are, and checks artifacts against it.
    assert report["versions"]["tvm"] == importlib.metadata.version("apache-tvm")

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny), dtype="float32").eval()
    prompt = tokenizer(PROMPT).input_ids
    _, expected, _ = greedy(model, prompt, STEPS)
    assert report["prompt"] == prompt
    assert report["tokens"] == expected

    eos = {model.generation_config.eos_token_id, tokenizer.eos_token_id} - {None}
    until_eos = next((expected[:i] for i, t in enumerate(expected) if t in eos), expected)
    for source in (artifact, archive):  # `vtool run` prints the completion: the same tokens, as text
        run = subprocess.run([str(venv / "bin" / "vtool"), "run", "--artifact", str(source), "--model", str(tiny),
                              "--prompt", PROMPT, "--max-tokens", str(STEPS), "--temperature", "0"],
                             capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.removesuffix("\n") == tokenizer.decode(until_eos, skip_special_tokens=True)

    # `vtool serve` from the same venv: the OpenAI client gets the same greedy tokens.
    import openai

    port = _free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen([str(venv / "bin" / "vtool"), "serve", "--artifact", str(archive), "--model",
                                   str(tiny), "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "128"],
                                  stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30)
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, log_path.read_text()[-3000:]
            try:
                model_id = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "vtool serve from the wheel did not come up in 120 s"
                time.sleep(0.5)
        done = client.completions.create(model=model_id, prompt=prompt, max_tokens=STEPS, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert done.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    finally:
        server.terminate()
        server.wait(timeout=30)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
