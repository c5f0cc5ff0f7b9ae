"""`data.name`: a dataset from the local Hugging Face caches, never downloaded.

Two caches hold a dataset a user fetched where there was network: the datasets cache
(HF_DATASETS_CACHE, else HF_HOME/datasets), where `load_dataset` leaves its Arrow files, and the
hub cache, where `hf download --repo-type dataset` leaves the repo's files. The first is read as
`load_dataset` reads it offline (its `cache` builder), without first trying the network as
`load_dataset` does when HF_HUB_OFFLINE is unset; the second is loaded as a local folder.
"""

from __future__ import annotations

from pipeline.config import DataConfig
from pipeline.errors import LowbitError


def load_named(data: DataConfig):
    """data.name's `data.split` (a Dataset), or all its splits (a DatasetDict)."""
    import datasets

    builder, missing = _arrow_cache(data)
    if builder is not None:
        return _split(data, lambda split: builder.as_dataset(split=split))
    folder = _hub_snapshot(data, missing)
    options = {"download_config": datasets.DownloadConfig(local_files_only=True)}
    return _split(
        data, lambda split: datasets.load_dataset(str(folder), data.config, split=split, **options)
    )


def _arrow_cache(data: DataConfig):
    """The datasets cache's builder for data.name and data.config, or None and why not."""
    from datasets.packaged_modules.cache.cache import Cache

    try:
        builder = Cache(
            repo_id=data.name,
            dataset_name=data.name.split("/")[-1],
            config_name=data.config,
            version="auto",
            hash="auto",
        )
    except ValueError as err:  # not cached, another config only, or several and none chosen
        return None, _flat(err)
    return builder, None


def _hub_snapshot(data: DataConfig, missing: str):
    """data.name's repo in the hub cache; one line naming both caches and the fixes if absent."""
    import datasets.config
    from huggingface_hub import constants

    from pipeline.hub import is_hub_id, snapshot

    if is_hub_id(data.name):
        try:
            return snapshot(data.name, None, "data.name", repo_type="dataset")
        except LowbitError:
            pass  # the message below names both caches
    load = f"datasets.load_dataset({data.name!r}" + (f", {data.config!r})" if data.config else ")")
    raise LowbitError(
        f"{data.source} is neither in the datasets cache ({datasets.config.HF_DATASETS_CACHE}: "
        f"{missing}) nor in the hub cache ({constants.HF_HUB_CACHE}); lowbit never downloads: "
        f'where there is network, with the HF_HOME this run sees, run `python -c "import '
        f'datasets; {load}"` or `hf download --repo-type dataset {data.name}`; or save the '
        "text to files and set data.path"
    )


def _split(data: DataConfig, load):
    """`load(data.split)`; one line when the dataset has no such split or config."""
    try:
        return load(data.split)
    except ValueError as err:  # `datasets` names the splits or configs it has
        raise LowbitError(
            f"{data.source} does not load ({_flat(err)}); set data.config and data.split to ones "
            "the dataset has (data.split=null: all its splits)"
        ) from None


def _flat(err: Exception) -> str:
    """`datasets`' message on one line (it lists what the cache holds on lines of their own)."""
    return "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
