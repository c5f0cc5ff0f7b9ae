"""Hugging Face hub ids in place of local folders, found in the local HF cache only.

`model.target.path=meta-llama/Llama-3.1-8B` names the snapshot that `hf download` (or a
`from_pretrained` on a machine with network) left in the hub cache: HF_HUB_CACHE, else
HF_HOME/hub, as huggingface_hub reads them when it is imported. Nothing is downloaded: lowbit
runs where there is no network, so an id the cache lacks is one line naming the command that
fetches it. A local directory of the same name wins. A snapshot's folder is named by its commit,
which the config pins (`ModelSpec.pinned`) so that a stage's fingerprint moves with the snapshot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pipeline.errors import LowbitError, first_line


def is_hub_id(path: str) -> bool:
    """Whether `path` can name a hub repo (`org/name` or `name`), by huggingface_hub's rules."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def local_dir(
    path: str, revision: str | None, key: str, repo_type: Literal["model", "dataset"] = "model"
) -> Path:
    """`path` itself, unless it names no directory but a hub id: then that repo's cached snapshot
    at `revision` (None: the default branch); `key` names the setting in the one line raised
    when the cache has none. A path that is neither is left to the checks of what it should hold."""
    if Path(path).is_dir() or not is_hub_id(path):
        return Path(path)
    return snapshot(path, revision, key, repo_type)


def snapshot(
    repo_id: str, revision: str | None, key: str, repo_type: Literal["model", "dataset"] = "model"
) -> Path:
    """The folder of `repo_id`'s cached snapshot at `revision`; one line naming the download
    command when the cache has none."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    options = (f" --repo-type {repo_type}" if repo_type != "model" else "") + (
        f" --revision {revision}" if revision else ""
    )
    fetch = f"`hf download {repo_id}{options}`"
    try:
        found = snapshot_download(
            repo_id, revision=revision, repo_type=repo_type, local_files_only=True
        )
    except IncompleteSnapshotError as err:
        raise LowbitError(
            f"{key}={repo_id}: its cached snapshot is incomplete ({first_line(err, 200)}); "
            f"complete it with {fetch} on a machine with network and the same HF_HOME"
        ) from None
    except LocalEntryNotFoundError:
        at = f" at revision {revision}" if revision else ""
        raise LowbitError(
            f"{key}={repo_id} is not a local directory and the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) holds no snapshot of it{at}; lowbit never downloads: "
            f"fetch it with {fetch} where there is network (with the HF_HOME or HF_HUB_CACHE "
            f"this run sees), or `hf download {repo_id}{options} --local-dir DIR` and set "
            f"{key}=DIR"
        ) from None
    return Path(found)


def commit(snapshot_dir: Path) -> str:
    """The commit hash of a cached snapshot: huggingface_hub names the folder by it."""
    return Path(snapshot_dir).name
