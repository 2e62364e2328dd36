"""--model as a Hugging Face hub id (runtime/weights/hub.py), against caches built here.

The cache is laid out as huggingface_hub writes it: models--{org}--{name}/refs/{revision}
(a commit hash), snapshots/{commit}/{file} (symlinks) and blobs/{sha}. The hub itself is
either switched off (HF_HUB_OFFLINE=1), unreachable (HF_ENDPOINT on a closed port of
127.0.0.1), or a small fake hub on 127.0.0.1 speaking the few routes huggingface_hub uses.
Nothing here contacts any host but 127.0.0.1.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import gguf
import huggingface_hub
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quant_gguf import write_tiny_gguf
from tiny_models import make_tiny_chat_model
from vtool import VtoolError
from vtool.runtime.weights.checkpoint import open_checkpoint
from vtool.runtime.weights.default_model import default_model_path
from vtool.runtime.weights.hub import parse_model_id, resolve_model_path

REPO = "tiny-org/tiny-chat"
C1 = hashlib.sha1(b"first commit").hexdigest()
C2 = hashlib.sha1(b"second commit").hexdigest()
ABSENT = hashlib.sha1(b"never cached").hexdigest()


def put_in_cache(cache: Path, repo_id: str, commit: str, files: dict[str, Path | bytes],
                 refs: tuple[str, ...] = ("main",)) -> Path:
    """Store `files` (repo path -> source) as huggingface_hub does: content in blobs/, a
    relative symlink per file under snapshots/{commit}/, and refs/{ref} holding the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    for name, src in files.items():
        data = src if isinstance(src, bytes) else src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return repo / "snapshots" / commit


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """The tiny chat model's files (config, generation config, weights, tokenizer) by name."""
    folder = make_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "model", default_model_path())
    return {p.name: p for p in folder.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gguf")
    return {"tiny-Q8_0.gguf": write_tiny_gguf(d / "q8.gguf", lambda name: gguf.GGMLQuantizationType.Q8_0),
            "tiny-F32.gguf": write_tiny_gguf(d / "f32.gguf", lambda name: gguf.GGMLQuantizationType.F32)}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache for this test, the hub switched off, and an empty working folder
    (so no relative path in a test can exist by accident)."""
    root = tmp_path / "hf-cache"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    return root


def test_offline_from_cache(cache, tiny):
    snapshot = put_in_cache(cache, REPO, C1, tiny)
    folder = resolve_model_path(REPO)
    assert folder == snapshot
    checkpoint = open_checkpoint(folder)
    assert checkpoint.config()["hidden_size"] == 64
    assert checkpoint.load("model.norm.weight").shape == (64,)


def test_offline_revision_branch_and_commit(cache, tiny):
    first = put_in_cache(cache, REPO, C1, tiny, refs=("main",))
    changed = dict(tiny, **{"config.json": json.dumps({**json.loads(tiny["config.json"].read_text()),
                                                      "rms_norm_eps": 1e-6}).encode()})
    second = put_in_cache(cache, REPO, C2, changed, refs=("v2",))
    assert resolve_model_path(REPO) == first
    assert resolve_model_path(REPO, revision="main") == first
    assert resolve_model_path(REPO, revision="v2") == second
    assert resolve_model_path(REPO, revision=C1) == first  # a full commit hash: snapshots/, no ref needed
    assert resolve_model_path(REPO, revision=C2) == second
    assert open_checkpoint(resolve_model_path(REPO, "v2")).config()["rms_norm_eps"] == 1e-6


def test_missing_model_refused_by_name(cache):
    with pytest.raises(VtoolError) as e:
        resolve_model_path("Qwen/Foo")
    msg = str(e.value)
    assert "'Qwen/Foo' (revision main) is not a local path" in msg
    assert f"not in the Hugging Face cache at {cache}" in msg
    assert "the hub could not be reached (HF_HUB_OFFLINE=1)" in msg


def test_missing_revision_refused(cache, tiny):
    put_in_cache(cache, REPO, C1, tiny)
    for rev in ("v9", ABSENT):
        with pytest.raises(VtoolError) as e:
            resolve_model_path(REPO, revision=rev)
        msg = str(e.value)
        assert f"(revision {rev})" in msg and f"not at revision '{rev}'" in msg
        assert f"refs: main -> {C1[:12]}" in msg and C1 in msg  # what is cached instead
        assert "HF_HUB_OFFLINE=1" in msg


def test_incomplete_snapshot_refused(cache, tiny):
    put_in_cache(cache, REPO, C1, {"config.json": tiny["config.json"], "tokenizer.json": tiny["tokenizer.json"]})
    with pytest.raises(VtoolError, match="has no config.json with model.safetensors or "
                                         "model.safetensors.index.json in its cached snapshot"):
        resolve_model_path(REPO)
    index = json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}).encode()
    put_in_cache(cache, "tiny-org/sharded", C1, {"config.json": tiny["config.json"], "model.safetensors.index.json": index})
    with pytest.raises(VtoolError, match=r"lists shards that are not there \(model-00002-of-00002.safetensors\)"):
        resolve_model_path("tiny-org/sharded")


def test_local_path_wins(cache, tiny, tmp_path):
    put_in_cache(cache, REPO, C1, tiny)
    local = Path(REPO)  # relative to the working folder: the same string as the hub id
    local.mkdir(parents=True)
    for name, src in tiny.items():
        shutil.copy(src, local / name)
    assert resolve_model_path(REPO) == local
    assert resolve_model_path(REPO, revision="v9") == local  # a revision means nothing for a path
    assert resolve_model_path(str(tiny["model.safetensors"].parent)) == tiny["model.safetensors"].parent


def test_gguf_selection(cache, tiny_ggufs):
    snapshot = put_in_cache(cache, "tiny-org/tiny-GGUF", C1, tiny_ggufs)
    path = resolve_model_path("tiny-org/tiny-GGUF/tiny-F32.gguf")
    assert path == snapshot / "tiny-F32.gguf"
    assert resolve_model_path("tiny-org/tiny-GGUF:Q8_0") == snapshot / "tiny-Q8_0.gguf"
    assert resolve_model_path("tiny-org/tiny-GGUF:q8_0") == snapshot / "tiny-Q8_0.gguf"
    checkpoint = open_checkpoint(path)
    assert checkpoint.format == "gguf" and checkpoint.config()["hidden_size"] == 128
    with pytest.raises(VtoolError, match=r"no GGUF file named \*-Q4_K_M.gguf .*GGUF files: tiny-F32.gguf, tiny-Q8_0.gguf"):
        resolve_model_path("tiny-org/tiny-GGUF:Q4_K_M")
    with pytest.raises(VtoolError, match="no other.gguf in its cached snapshot"):
        resolve_model_path("tiny-org/tiny-GGUF/other.gguf")
    with pytest.raises(VtoolError, match="'Q9_Z' after ':' is not a GGUF quantization type"):
        resolve_model_path("tiny-org/tiny-GGUF:Q9_Z")
    with pytest.raises(VtoolError, match="GGUF file 'models/missing.gguf' does not exist"):
        resolve_model_path("models/missing.gguf")
    # a plain id of a GGUF-only repo says how to pick a file
    with pytest.raises(VtoolError, match=r"it holds GGUF files \(tiny-F32.gguf, tiny-Q8_0.gguf\): name one as "
                                         r"tiny-org/tiny-GGUF/FILE.gguf or tiny-org/tiny-GGUF:QUANT"):
        resolve_model_path("tiny-org/tiny-GGUF")


# --- id validation -------------------------------------------------------------------------

NAME = st.from_regex(r"[A-Za-z0-9]([A-Za-z0-9_]|-(?=[A-Za-z0-9_])|\.(?=[A-Za-z0-9_])){0,20}", fullmatch=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(org=NAME, name=NAME)
def test_valid_ids_go_to_the_cache(cache, org, name):
    """Any org/name huggingface_hub accepts is looked up, and refused as not cached (not as an invalid id)."""
    model = f"{org}/{name}"
    if ".." in model or "--" in model or model.endswith(".git") or model.lower().endswith(".gguf"):
        return  # the validator's other rules, and vtool's .gguf file names
    assert parse_model_id(model).repo_id == model
    with pytest.raises(VtoolError, match="is not in the Hugging Face cache"):
        resolve_model_path(model)


BAD_IDS = st.one_of(
    st.builds(lambda a, b, c: f"{a}/{b}/{c}", NAME, NAME, NAME),  # three parts (not .gguf)
    st.builds(lambda a, b: f"{a}/{b}", NAME, st.sampled_from(["x y", "a--b", "a..b", "-a", "a.", "é!", "x.git"])),
    st.text(alphabet=" !#$%&*?@[]{}", min_size=1, max_size=8),
).filter(lambda s: not s.lower().endswith(".gguf")  # those read as a GGUF file name (test_gguf_selection)
          and s.strip())  # blank ones are "model is empty" (test_empty_model_refused)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(model=BAD_IDS)
def test_invalid_ids_refused(cache, model):
    with pytest.raises(VtoolError) as e:
        resolve_model_path(model)
    assert repr(model) in str(e.value) and "is neither an existing path nor a Hugging Face model id" in str(e.value)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(model=st.one_of(st.builds(lambda a: f"/no/such/{a}", NAME), st.builds(lambda a: f"./{a}", NAME),
                       st.builds(lambda a: f"../{a}/x", NAME)))
def test_missing_paths_refused_as_paths(cache, model):
    # Written as a path (absolute, ./, ../, ~), so never read as a hub id.
    with pytest.raises(VtoolError) as e:
        resolve_model_path(model)
    assert f"model path {model!r} does not exist" in str(e.value)


def test_empty_model_refused(cache):
    with pytest.raises(VtoolError, match="model is empty"):
        resolve_model_path("  ")


# --- the hub unreachable (a closed port), in a process of its own -------------------------

PROBE = r"""
import json, sys
from vtool import VtoolError
from vtool.runtime.weights.hub import resolve_model_path
out = {}
for model in sys.argv[1:]:
    try:
        out[model] = str(resolve_model_path(model))
    except VtoolError as e:
        out[model] = "refused: " + str(e)
print(json.dumps(out))
"""


def test_unreachable_hub_falls_back_to_cache(cache, tiny):
    snapshot = put_in_cache(cache, REPO, C1, tiny)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    # port 9 (discard) is closed here: the connection is refused at once; the timeouts bound anything slower
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5",
               HF_HUB_CACHE=str(cache))
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", PROBE, REPO, "Qwen/Foo"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - start < 60
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out[REPO] == str(snapshot)
    msg = out["Qwen/Foo"]
    assert msg.startswith("refused: model 'Qwen/Foo' (revision main) is not a local path, is not in the Hugging "
                          f"Face cache at {cache}, and the hub at http://127.0.0.1:9 could not be reached"), msg
    assert "Connection refused" in msg


# --- a fake hub on 127.0.0.1 ---------------------------------------------------------------


class FakeHub:
    """The routes huggingface_hub calls to resolve and download: model info, the tree listing
    and resolve/ (HEAD for the metadata, GET for the bytes). Repos: id -> {"refs": {name:
    commit}, "files": {commit: {path: bytes}}}."""

    def __init__(self, repos: dict):
        self.repos = repos
        self.fetched: list[str] = []  # repo paths whose bytes were sent
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub.answer(self, body=False)

            def do_GET(self):
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def commit(self, repo: dict, rev: str) -> str | None:
        return repo["refs"].get(rev) or (rev if rev in repo["files"] else None)

    def answer(self, req: BaseHTTPRequestHandler, body: bool) -> None:
        parts = [unquote(p) for p in urlsplit(req.path).path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo_id, kind, rev = "/".join(parts[2:4]), parts[4], parts[5]
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo_id, kind, rev = "/".join(parts[:2]), "resolve", parts[3]
        else:
            return self.send(req, 404, b"{}", {"X-Error-Code": "EntryNotFound"}, body)
        repo = self.repos.get(repo_id)
        if repo is None:
            return self.send(req, 401, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)
        commit = self.commit(repo, rev)
        if commit is None:
            return self.send(req, 404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"}, body)
        files = repo["files"][commit]
        if kind == "revision":
            info = {"id": repo_id, "sha": commit, "siblings": [{"rfilename": f} for f in sorted(files)]}
            return self.send(req, 200, json.dumps(info).encode(), {}, body)
        if kind == "tree":
            tree = [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                    for f, b in sorted(files.items())]
            return self.send(req, 200, json.dumps(tree).encode(), {}, body)
        path = "/".join(parts[4:])
        if path not in files:
            return self.send(req, 404, b"{}", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit}, body)
        data = files[path]
        if body:
            self.fetched.append(path)
        return self.send(req, 200, data, {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'},
                         body)

    @staticmethod
    def send(req: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
        req.send_response(status)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **headers}.items():
            req.send_header(k, v)
        req.end_headers()
        if body:
            req.wfile.write(data)


@pytest.fixture
def online(cache, monkeypatch):
    """The hub switched on and pointed at a fake one; huggingface_hub read HF_HUB_OFFLINE=1 at
    import (conftest), so its module flag is switched off for the test too."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "5")
    hubs: list[FakeHub] = []

    def start(repos: dict) -> FakeHub:
        hub = FakeHub(repos)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        hubs.append(hub)
        return hub

    yield start
    for hub in hubs:
        hub.server.shutdown()
        hub.server.server_close()


def test_download_fetches_only_what_the_model_needs(online, cache, tiny, monkeypatch):
    files = {name: p.read_bytes() for name, p in tiny.items()}
    extra = {"README.md": b"# tiny", "pytorch_model.bin": b"\0" * 64, "original/consolidated.safetensors": b"\0" * 64,
             "tiny-Q8_0.gguf": b"GGUF"}
    hub = online({REPO: {"refs": {"main": C1}, "files": {C1: {**files, **extra}}}})
    folder = resolve_model_path(REPO)
    assert folder == cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / C1
    wanted = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "model.safetensors"} | ({"chat_template.jinja"} & set(files))
    assert set(hub.fetched) == wanted
    assert (cache / f"models--{REPO.replace('/', '--')}" / "refs" / "main").read_text() == C1
    assert open_checkpoint(folder).config()["hidden_size"] == 64
    # The second time nothing is fetched; with the hub gone the cache answers alone.
    resolve_model_path(REPO)
    assert len(hub.fetched) == len(wanted)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_path(REPO) == folder


def test_download_sharded_and_gguf(online, cache, tiny, tiny_ggufs):
    weights = tiny["model.safetensors"].read_bytes()
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    shard_repo = {"config.json": tiny["config.json"].read_bytes(), "model.safetensors.index.json":
                  json.dumps(index).encode(), "model-00001-of-00002.safetensors": weights,
                  "consolidated.safetensors": weights}
    gguf_repo = {name: p.read_bytes() for name, p in tiny_ggufs.items()}
    hub = online({"tiny-org/sharded": {"refs": {"main": C1}, "files": {C1: shard_repo}},
                  "tiny-org/tiny-GGUF": {"refs": {"main": C1, "v2": C2}, "files": {C1: gguf_repo, C2: gguf_repo}}})
    folder = resolve_model_path("tiny-org/sharded")
    assert sorted(hub.fetched) == ["config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json"]
    assert (folder / "model-00001-of-00002.safetensors").is_file()
    hub.fetched.clear()
    path = resolve_model_path("tiny-org/tiny-GGUF:Q8_0", revision="v2")
    assert path.name == "tiny-Q8_0.gguf" and path.parent.name == C2 and hub.fetched == ["tiny-Q8_0.gguf"]
    assert open_checkpoint(path).format == "gguf"
    with pytest.raises(VtoolError, match=r"no other.gguf on the hub at .*\(GGUF files: tiny-F32.gguf, tiny-Q8_0.gguf\)"):
        resolve_model_path("tiny-org/tiny-GGUF/other.gguf")


def test_hub_answers_no(online, cache):
    hub = online({REPO: {"refs": {"main": C1}, "files": {C1: {"config.json": b"{}"}}}})
    with pytest.raises(VtoolError) as e:
        resolve_model_path("tiny-org/absent")
    assert str(e.value) == (f"model 'tiny-org/absent' (revision main) is not a local path, is not in the Hugging Face "
                            f"cache at {cache}, and the hub at {hub.url} has no model 'tiny-org/absent' (or it is "
                            "private: set HF_TOKEN or run `hf auth login`)")
    with pytest.raises(VtoolError, match=f"model '{REPO}' has no revision 'v9' on the hub at {hub.url}"):
        resolve_model_path(REPO, revision="v9")
    with pytest.raises(VtoolError, match="has no config.json with model.safetensors .* on the hub at"):
        resolve_model_path(REPO)


# --- an id through the Python API: resolved, built and run ---------------------------------


def test_llm_by_hub_id_builds_and_generates(cache, tiny):
    from vtool import LLM, SamplingParams

    put_in_cache(cache, REPO, C1, tiny)
    llm = LLM(model=REPO, revision="main", max_model_len=64)
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
