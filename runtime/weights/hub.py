"""`--model NAME`: a Hugging Face hub id, resolved through huggingface_hub's cache as vLLM does.

Accepted, after an existing local path (which always wins):

    org/name              a safetensors model repo; config.json, generation_config.json, the
                          tokenizer files and model.safetensors (or model.safetensors.index.json
                          and the shards it lists) are fetched, nothing else
    org/name/FILE.gguf    one GGUF file of a repo
    org/name:QUANT        the repo's one GGUF file named *-QUANT.gguf (or *.QUANT.gguf), like
                          vLLM's repo_id:quant_type (QUANT: Q4_K_M, Q8_0, F16, ...)

Unless the hub is switched off (HF_HUB_OFFLINE=1), the hub is asked once (model_info, bounded
by HF_HUB_ETAG_TIMEOUT seconds); when it answers, what the model needs is downloaded into the
cache (files already there are reused). When it is off or cannot be reached, the cache alone
answers (snapshot_download(local_files_only=True)). Anything else is a VtoolError naming the
model, the revision and what was tried. huggingface_hub is imported only for a hub id.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from types import ModuleType

from vtool import VtoolError

DEFAULT_REVISION = "main"
CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"  # the names safetensors_reader opens
INDEX_FILE = "model.safetensors.index.json"
# Beside the weights, what vtool reads from a model folder (checkpoint config, stop ids, tokenizer, chat template).
META_FILES = (CONFIG, "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
ACCEPTED = ("a model folder, a .gguf file, or a Hugging Face model id: org/name, or org/name/FILE.gguf or "
            "org/name:QUANT for one GGUF file of a repo")
# vLLM's extended GGUF quant names: a GGML type plus one of these (Q4_K_M -> Q4_K)
QUANT_SUFFIXES = ("_M", "_S", "_L", "_XL", "_XS", "_XXS")
_TRUE = {"1", "ON", "YES", "TRUE"}  # what huggingface_hub reads as true


class HubUnavailable(Exception):
    """The hub gave no usable answer (unreachable, offline, or no such repo for us); the cache decides."""


@dataclasses.dataclass(frozen=True)
class HubModel:
    """A parsed hub id: the repo, plus at most one way of picking a GGUF file in it."""

    repo_id: str
    filename: str | None = None  # org/name/FILE.gguf
    quant: str | None = None  # org/name:QUANT

    def __str__(self) -> str:
        if self.filename:
            return f"{self.repo_id}/{self.filename}"
        return f"{self.repo_id}:{self.quant}" if self.quant else self.repo_id


def _hf() -> ModuleType:
    # Lazy: a local --model never imports huggingface_hub. Its submodules load on attribute
    # access, except `constants`, which is imported here by name.
    import huggingface_hub
    import huggingface_hub.constants  # noqa: F401

    return huggingface_hub


def is_gguf_quant(name: str) -> bool:
    """A GGML quantization type (Q8_0, F16, ...) or one with a size suffix (Q4_K_M), as vLLM accepts."""
    import gguf

    members = gguf.GGMLQuantizationType.__members__
    upper = name.upper()
    return upper in members or any(upper.endswith(s) and upper[: -len(s)] in members for s in QUANT_SUFFIXES)


def parse_model_id(model: str) -> HubModel:
    """Split and check a hub id (huggingface_hub's validate_repo_id); refuse anything else by name."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo_id, filename, quant = model, None, None
    if model.lower().endswith(".gguf"):
        parts = model.split("/")
        if len(parts) < 3:  # "x.gguf", "dir/x.gguf": a local file that is not there, not a hub id
            raise VtoolError(f"GGUF file {model!r} does not exist; a GGUF file of a hub repo is named org/name/FILE.gguf")
        if any(p in ("", ".", "..") for p in parts[2:]):
            raise VtoolError(f"model {model!r}: {'/'.join(parts[2:])!r} is not a file name in a repo; accepted: {ACCEPTED}")
        repo_id, filename = "/".join(parts[:2]), "/".join(parts[2:])
    elif ":" in model:
        repo_id, quant = model.rsplit(":", 1)
        if "/" not in repo_id or not re.fullmatch(r"[A-Za-z0-9_]+", quant) or not is_gguf_quant(quant):
            raise VtoolError(f"model {model!r} is neither an existing path nor a Hugging Face model id: {quant!r} after "
                             f"':' is not a GGUF quantization type (e.g. Q4_K_M, Q8_0, F16); accepted: {ACCEPTED}")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise VtoolError(f"model {model!r} is neither an existing path nor a Hugging Face model id ({e}); "
                         f"accepted: {ACCEPTED}") from None
    return HubModel(repo_id, filename, quant)


def hub_cache_dir() -> Path:
    """huggingface_hub's model cache: HF_HUB_CACHE, else $HF_HOME/hub, else its default. Read now:
    huggingface_hub reads its environment once, at import, and the cache is passed to it explicitly."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(_hf().constants.HF_HUB_CACHE)


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or _hf().constants.ENDPOINT).rstrip("/")


def offline_reason() -> str | None:
    """Why the hub is not to be asked (the variable that says so), or None."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # huggingface_hub honours both
        value = os.environ.get(var, "")
        if value.upper() in _TRUE:
            return f"{var}={value}"
    if _hf().constants.HF_HUB_OFFLINE:  # set when huggingface_hub was imported; its requests refuse anyway
        return "huggingface_hub is in offline mode"
    return None


def _timeout() -> float:
    hf = _hf()
    return float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or hf.constants.HF_HUB_ETAG_TIMEOUT)


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """A local model folder or .gguf file for `model`: an existing path as it is (revision is then
    ignored, as vLLM does), else a hub id resolved at `revision` (branch, tag or commit hash;
    default main) through the Hugging Face cache, downloading what is missing when the hub answers."""
    model = str(model)
    if not model.strip():
        raise VtoolError(f"model is empty; accepted: {ACCEPTED}")
    try:
        local = Path(model).expanduser()
    except RuntimeError:  # "~someone/..." of an unknown user: not a path here
        local = Path(model)
    if local.exists():
        return local
    if local.is_absolute() or model.startswith(("./", "../", "~")):
        # Written as a path, so it cannot be a hub id: say what is missing.
        raise VtoolError(f"model path {model!r} does not exist; accepted: {ACCEPTED}")
    spec = parse_model_id(model)
    rev = revision or DEFAULT_REVISION
    cache = hub_cache_dir()
    reason = offline_reason()
    if reason is not None:
        why = f"the hub could not be reached ({reason})"
    else:
        try:
            return _download(spec, rev, cache)
        except HubUnavailable as e:
            why = str(e)
    return _from_cache(spec, rev, cache, why)


def _download(spec: HubModel, rev: str, cache: Path) -> Path:
    """Ask the hub once; then download only what the model needs. HubUnavailable when it cannot say."""
    hf = _hf()
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    endpoint = hub_endpoint()
    try:
        info = hf.HfApi(endpoint=endpoint).model_info(spec.repo_id, revision=rev, timeout=_timeout())
    except RevisionNotFoundError:
        raise VtoolError(f"model {str(spec)!r} has no revision {rev!r} on the hub at {endpoint} "
                         "(accepted: a branch, a tag or a commit hash of the repo)") from None
    except GatedRepoError:
        # As huggingface_hub does, a cached copy is still used; else this is the refusal.
        raise HubUnavailable(f"the model is gated on the hub at {endpoint}: accept its terms on the model page and "
                             "set HF_TOKEN (or run `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise HubUnavailable(f"the hub at {endpoint} has no model {spec.repo_id!r} (or it is private: set HF_TOKEN "
                             "or run `hf auth login`)") from None
    except Exception as e:  # refused, timed out, DNS, 5xx, offline mode: whatever the transport raises
        raise HubUnavailable(f"the hub at {endpoint} could not be reached ({type(e).__name__}: {e})") from None
    files = sorted(s.rfilename for s in (info.siblings or ()))
    common = dict(cache_dir=str(cache), endpoint=endpoint, etag_timeout=_timeout())
    try:
        if spec.filename or spec.quant:
            name = _pick_gguf(spec, rev, files, f"on the hub at {endpoint}")
            return Path(hf.hf_hub_download(spec.repo_id, name, revision=rev, **common))
        wanted = [f for f in META_FILES if f in files]
        if CONFIG not in files or (INDEX_FILE not in files and SINGLE_FILE not in files):
            raise VtoolError(_not_a_model(spec, rev, files, f"on the hub at {endpoint}"))
        # The index, when there is one, names the shards: only those are fetched (a repo may
        # also hold a consolidated copy or an original/ folder).
        wanted.append(INDEX_FILE if INDEX_FILE in files else SINGLE_FILE)
        folder = Path(hf.snapshot_download(spec.repo_id, revision=rev, allow_patterns=wanted, **common))
        if INDEX_FILE in wanted:
            shards = sorted(set(_weight_map(folder / INDEX_FILE).values())) if (folder / INDEX_FILE).is_file() else []
            # the commit just fetched (the folder's name), so a branch moving meanwhile cannot mix two commits
            hf.snapshot_download(spec.repo_id, revision=folder.name, allow_patterns=shards, **common)
        return folder
    except VtoolError:
        raise
    except Exception as e:
        raise VtoolError(f"downloading model {str(spec)!r} (revision {rev}) from {endpoint} into {cache} failed: "
                         f"{type(e).__name__}: {e}") from e


def _from_cache(spec: HubModel, rev: str, cache: Path, why: str) -> Path:
    """The cached snapshot of `rev`, checked to hold what vtool reads; else refused, saying `why`
    the hub did not answer."""
    hf = _hf()
    from huggingface_hub.errors import LocalEntryNotFoundError

    head = f"model {str(spec)!r} (revision {rev}) is not a local path"
    repo_dir = cache / f"models--{spec.repo_id.replace('/', '--')}"  # huggingface_hub's repo_folder_name
    if not repo_dir.is_dir():
        raise VtoolError(f"{head}, is not in the Hugging Face cache at {cache}, and {why}")
    try:
        folder = Path(hf.snapshot_download(spec.repo_id, revision=rev, cache_dir=str(cache), local_files_only=True))
    except LocalEntryNotFoundError as e:
        # A snapshot huggingface_hub knows to be partial (vtool fetches a subset of a repo on
        # purpose) still names its folder; what vtool needs is checked below.
        snapshot = getattr(e, "snapshot_path", None)
        if not snapshot:
            raise VtoolError(f"{head}; the Hugging Face cache at {cache} holds it but not at revision {rev!r} "
                             f"({_cached_revisions(repo_dir)}), and {why}") from None
        folder = Path(snapshot)
    where = f"in its cached snapshot {folder}"
    present = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    if spec.filename or spec.quant:
        return folder / _pick_gguf(spec, rev, present, where, why)
    if CONFIG not in present or (INDEX_FILE not in present and SINGLE_FILE not in present):
        raise VtoolError(_not_a_model(spec, rev, present, where) + f"; and {why}")
    if INDEX_FILE in present:
        missing = sorted({s for s in _weight_map(folder / INDEX_FILE).values() if not (folder / s).is_file()})
        if missing:
            raise VtoolError(f"model {str(spec)!r} (revision {rev}): {where}, {INDEX_FILE} lists shards that are not "
                             f"there ({', '.join(missing)}); and {why}")
    return folder


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, ValueError, AttributeError) as e:
        raise VtoolError(f"{index}: not a readable safetensors index ({e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise VtoolError(f"{index}: has no 'weight_map' of tensor name -> shard file")
    return weight_map


def _pick_gguf(spec: HubModel, rev: str, files: list[str], where: str, why: str | None = None) -> str:
    """The one GGUF file `spec` names among `files` (repo paths); refused naming what is there."""
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    tail = f"; and {why}" if why else ""
    listing = f"GGUF files: {', '.join(ggufs)}" if ggufs else "no GGUF files"
    if spec.filename:
        if spec.filename in files:
            return spec.filename
        raise VtoolError(f"model {str(spec)!r} (revision {rev}): no {spec.filename} {where} ({listing}){tail}")
    assert spec.quant is not None
    # name-QUANT.gguf (bartowski, unsloth, vLLM's patterns) or name.QUANT.gguf (TheBloke, llama.cpp)
    pattern = re.compile(rf".+[-._]{re.escape(spec.quant)}\.gguf", re.IGNORECASE)
    hits = [f for f in ggufs if pattern.fullmatch(f.rsplit("/", 1)[-1])]
    if len(hits) == 1:
        return hits[0]
    if not hits:
        raise VtoolError(f"model {str(spec)!r} (revision {rev}): no GGUF file named *-{spec.quant}.gguf {where} "
                         f"({listing}){tail}")
    raise VtoolError(f"model {str(spec)!r} (revision {rev}): {len(hits)} GGUF files match {spec.quant} {where} "
                     f"({', '.join(hits)}); name one as {spec.repo_id}/FILE.gguf{tail}")


def _not_a_model(spec: HubModel, rev: str, files: list[str], where: str) -> str:
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    if ggufs:
        hint = (f"it holds GGUF files ({', '.join(ggufs[:8])}{', ...' if len(ggufs) > 8 else ''}): name one as "
                f"{spec.repo_id}/FILE.gguf or {spec.repo_id}:QUANT")
    else:
        hint = f"found: {', '.join(files[:12]) or 'nothing'}; vtool reads safetensors and GGUF weights"
    return (f"model {str(spec)!r} (revision {rev}) has no {CONFIG} with {SINGLE_FILE} or {INDEX_FILE} {where}: {hint}")


def _cached_revisions(repo_dir: Path) -> str:
    refs = sorted(p for p in (repo_dir / "refs").rglob("*") if p.is_file()) if (repo_dir / "refs").is_dir() else []
    named = [f"{p.relative_to(repo_dir / 'refs')} -> {p.read_text().strip()[:12]}" for p in refs]
    commits = sorted(p.name for p in (repo_dir / "snapshots").iterdir()) if (repo_dir / "snapshots").is_dir() else []
    parts = ([f"refs: {', '.join(named)}"] if named else []) + ([f"commits: {', '.join(commits)}"] if commits else [])
    return "; ".join(parts) or "no revisions"
