"""Download a model snapshot from the Hugging Face Hub (or any server speaking its API)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from rich.progress import Progress

from modelship.pipeline.errors import AcquireError, HubUnavailableError
from modelship.progress import rich_tqdm_class

# What a model needs to be served: weights, config, tokenizer and chat template.
ALLOW_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
]
# Seconds before an unreachable Hub is reported as such instead of hanging.
CONNECT_TIMEOUT_S = 10.0
_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


def looks_like_repo_id(source: str) -> bool:
    return bool(_REPO_ID_RE.match(source)) and not source.endswith(".gguf")


def is_commit_sha(revision: str) -> bool:
    return bool(_COMMIT_RE.match(revision))


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def resolve_revision(repo_id: str, revision: str | None) -> str:
    """The commit sha that `revision` (branch, tag or sha; None = main) points at now."""
    api = HfApi(endpoint=endpoint())
    try:
        info = api.model_info(repo_id, revision=revision, timeout=CONNECT_TIMEOUT_S)
    except Exception as exc:
        raise _hub_error(exc, repo_id, revision) from exc
    if not info.sha:
        raise AcquireError(f"the Hub returned no commit for {repo_id}@{revision or 'main'}")
    return info.sha


def download_snapshot(
    repo_id: str, commit: str, cache_dir: Path, progress: Progress | None = None
) -> Path:
    """Download (resumably, into `cache_dir`) the allowed files of `repo_id` at `commit`."""
    try:
        folder = snapshot_download(
            repo_id,
            revision=commit,
            cache_dir=cache_dir,
            allow_patterns=ALLOW_PATTERNS,
            endpoint=endpoint(),
            etag_timeout=CONNECT_TIMEOUT_S,
            tqdm_class=rich_tqdm_class(progress) if progress is not None else None,
        )
    except Exception as exc:
        raise _hub_error(exc, repo_id, commit) from exc
    return Path(folder)


def _hub_error(exc: Exception, repo_id: str, revision: str | None) -> AcquireError:
    at = f"{repo_id}@{revision or 'main'}"
    if isinstance(exc, AcquireError):
        return exc
    if isinstance(exc, RevisionNotFoundError):
        return AcquireError(f"revision {revision!r} not found in {repo_id} on the Hub")
    if isinstance(exc, GatedRepoError):
        return AcquireError(
            f"{repo_id} is gated: accept its terms on the Hub and set HF_TOKEN to a token "
            "that has access"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return AcquireError(
            f"model {repo_id!r} not found on the Hub (or it is private: set HF_TOKEN)"
        )
    if isinstance(exc, HFValidationError):
        return AcquireError(f"{repo_id!r} is not a valid Hub repo id ({exc})")
    if _is_connection_error(exc):
        return HubUnavailableError(
            f"cannot reach the Hugging Face Hub at {endpoint()} for {at} "
            f"({type(_root_cause(exc)).__name__}); this machine may be offline. "
            "Use `modelship acquire demo` or a local folder or .gguf path instead."
        )
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        error = HubUnavailableError if status == 429 or (status or 0) >= 500 else AcquireError
        return error(f"the Hub answered HTTP {status or '?'} for {at}")
    return AcquireError(f"download of {at} failed: {type(exc).__name__}: {exc}")


def _root_cause(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def _is_connection_error(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, httpx.TransportError | OfflineModeIsEnabled | ConnectionError):
            return True
        if type(seen).__name__ == "LocalEntryNotFoundError":
            return True
        seen = seen.__cause__ or seen.__context__
    return False
