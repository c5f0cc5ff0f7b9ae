"""data.name: a dataset from the local datasets cache or the hub cache, never downloaded; its
text tokenized by Dataset.map over data.num_proc processes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.config import DataConfig, ModelConfig, RunConfig, data_cfg
from pipeline.data.text import Corpus, load_splits
from pipeline.errors import LowbitError
from pipeline.inputs import check_inputs
from tests.conftest import make_cfg, put_in_hub_cache

WORDS = ["river", "stone", "cloud", "ember", "moss", "lantern", "harbor", "willow"]
GIVEN = {
    split: [f"{split} line {i}: {WORDS[i % 8]} and {WORDS[(i * 3) % 8]} {i}" for i in range(n)]
    for split, n in (("train", 60), ("validation", 6), ("test", 6))
}
CONFIGS = {"tiny-raw": str, "tiny-upper": str.upper}


def dataset_repo(root: Path) -> Path:
    """A script-free dataset repo as the hub holds one: two configs in its card, JSON Lines."""
    card = ["---", "configs:"]
    for config, change in CONFIGS.items():
        card += [f"- config_name: {config}", "  data_files:"]
        for split, lines in GIVEN.items():
            (root / config).mkdir(parents=True, exist_ok=True)
            rows = [json.dumps({"text": change(line)}) for line in lines]
            (root / config / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
            card += [f"  - split: {split}", f"    path: {config}/{split}.jsonl"]
    (root / "README.md").write_text("\n".join([*card, "---", "A tiny corpus."]) + "\n")
    return root


@pytest.fixture
def cached(hf_home, tmp_path) -> str:
    """`tinytext`'s tiny-raw config in the datasets cache, as `load_dataset` leaves it; its source
    removed, so only the cache can serve it."""
    import datasets

    repo = dataset_repo(tmp_path / "tinytext")
    datasets.load_dataset(str(repo), "tiny-raw")
    shutil.rmtree(repo)
    assert list((hf_home / "datasets" / "tinytext").glob("tiny-raw/*/*/dataset_info.json"))
    return "tinytext"


def test_a_cached_dataset_is_read_by_name_and_config_with_its_splits(cached):
    assert load_splits(DataConfig(name=cached, config="tiny-raw")) == GIVEN
    only_train = load_splits(DataConfig(name=cached, config="tiny-raw", split="train"))
    assert sorted(d for docs in only_train.values() for d in docs) == sorted(GIVEN["train"])
    assert only_train["test"] and only_train["validation"]  # carved from train


def test_a_dataset_repo_in_the_hub_cache_is_read_by_name(hf_home, tmp_path):
    repo = dataset_repo(tmp_path / "src")
    put_in_hub_cache(repo, hf_home / "hub", "org/tinytext", "c3" * 20, repo_type="dataset")
    splits = load_splits(DataConfig(name="org/tinytext", config="tiny-upper"))
    assert splits == {split: [line.upper() for line in lines] for split, lines in GIVEN.items()}


def one_line(data: DataConfig) -> str:
    with pytest.raises(LowbitError) as info:
        check_inputs(ModelConfig(), data)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_name_in_neither_cache_is_one_line_naming_the_downloads(hf_home):
    message = one_line(DataConfig(name="org/absent", config="c"))
    assert message.startswith("data.name=org/absent (data.config=c) is neither in the datasets")
    assert str(hf_home / "datasets") in message and str(hf_home / "hub") in message
    assert "datasets.load_dataset('org/absent', 'c')" in message
    assert "`hf download --repo-type dataset org/absent`" in message


def test_a_config_or_split_the_cache_lacks_is_one_line_naming_what_it_has(cached):
    message = one_line(DataConfig(name=cached, config="tiny-upper"))
    assert "Available configs in the cache: ['tiny-raw']" in message
    message = one_line(DataConfig(name=cached, config="tiny-raw", split="dev"))
    assert "data.split=dev" in message and "train" in message and "validation" in message
    message = one_line(DataConfig(name=cached, config="tiny-raw", text_field="body"))
    assert "has no column 'body'; set data.text_field to one of ['text']" in message


def test_tokens_over_several_processes_are_those_of_one(cached):
    from pipeline.models.hf import train_tokenizer

    tokenizer = train_tokenizer(GIVEN["train"], 300)
    by_one, by_two = (
        Corpus(DataConfig(name=cached, config="tiny-raw", num_proc=n), tokenizer).stream("train")
        for n in (1, 2)
    )
    ids = [tokenizer.encode(d, add_special_tokens=False) for d in GIVEN["train"]]
    direct = [t for doc in ids for t in [*doc, tokenizer.eos_token_id]]
    assert torch.equal(by_one, torch.tensor(direct)) and torch.equal(by_two, by_one)
    # How many processes tokenize is not part of any fingerprint: the tokens are the same.
    hashed = RunConfig(0, data=DataConfig(num_proc=4)).asdict()
    assert hashed == RunConfig(0, data=DataConfig()).asdict() and "num_proc" not in hashed["data"]


@pytest.mark.parametrize(
    "overrides, key",
    [(["data.name=x", "data.path=/tmp"], "data.name"), (["data.config=c"], "data.config")],
)
def test_name_and_path_exclude_each_other_and_config_needs_a_name(overrides, key):
    with pytest.raises(LowbitError, match=f"`{key}`"):
        data_cfg(make_cfg(*overrides))
