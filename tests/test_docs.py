"""The docs hold to the repository: the rendered results are the committed ones, every repo file a
doc or a pipeline docstring cites exists, and README's config claims match conf/."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from bench import render
from bench._common import parsed_tables, result_table, write_result
from tests.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
EXTENSIONS = "py|md|yaml|yml|json|toml|sbatch|txt|sh|cfg|ini"


def _tracked_tops() -> list[str]:
    """The repo's tracked top-level names (a run's `outputs/`, README's first command, is not)."""
    try:
        files = subprocess.run(
            ["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True, check=True
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):  # no git: every entry but the env's
        return [p.name for p in REPO.iterdir() if p.name not in (".git", ".venv", "outputs")]
    return sorted({f.split("/")[0] for f in files})


# A repo-relative path: starts with a top-level entry of the repository, ends with a known
# extension; placeholders (<stage>, {name}, *) make it a pattern, not a file.
TOP = "|".join(re.escape(name) for name in _tracked_tops())
PATH = re.compile(rf"(?<![\w/.<{{$~-])((?:{TOP})/[\w./-]*\.(?:{EXTENSIONS}))(?![\w/*<{{])")
LINK = re.compile(r"\]\(([^)\s]+)\)")
BACKTICKED = re.compile(r"`([^`\s]+/[^`\s]+)`")
FORMAT = re.compile(r"\b(?:int[2348](?:g\d+)?(?:-sym)?|exp4g\d+)\b")
NUMBERS = {w: i for i, w in enumerate(("zero", "one", "two", "three", "four", "five", "six",
                                        "seven", "eight", "nine", "ten"))}  # fmt: skip
# Files of other repositories the docs cite by their path there.
EXTERNAL = {"docs/zh/knowledge_base/quantization_format/ascendv1/term_ascendv1.md"}


def test_the_rendered_docs_are_the_committed_results():
    assert render.main(["--check"]) == 0, "run `python -m bench.render` and commit the result"


def test_the_check_fails_when_a_committed_result_changes(monkeypatch, capsys):
    committed = render.load

    def changed(name: str, root: Path = REPO) -> dict | None:
        result = committed(name, root)
        return result and {**result, "date": "another day"}

    monkeypatch.setattr(render, "load", changed)
    assert render.main(["--check"]) == 1
    assert "docs/benchmarks.md differs from the committed results" in capsys.readouterr().out


def test_every_bench_has_one_section():
    doc = (REPO / render.DOC).read_text()
    sections = re.findall(r"^## `bench/(\w+)\.py`$", doc, re.M)
    assert sections == render.benches()
    results = {p.name.split("@")[0] for p in (REPO / render.RESULTS).iterdir() if p.is_dir()}
    assert results <= set(sections), f"results of no bench: {results - set(sections)}"


def test_a_result_renders_its_command_commit_machine_tables_and_goals(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench/packing.py", "--size", "64"])
    rows = [{"bits": 2, "GB/s": 1.5}, {"bits": 4, "GB/s": 3.25}]
    tables = [
        result_table("Packing", rows),
        *parsed_tables("Fit", ["| a | b |", "|---|---|", "| x | 1 |"]),
    ]
    goals = [{"goal": "speed", "value": 3.25, "want": ">= 3", "verdict": "met"}]
    path = write_result(tmp_path / "docs/results/packing", "packing", tables, goals)
    result = json.loads(path.read_text())
    assert result["command"] == "python -m bench.packing --size 64"
    assert result["tables"][1] == {"title": "Fit", "columns": ["a", "b"], "rows": [["x", "1"]]}
    text = render.section("packing", render.load("packing", tmp_path))
    assert "python -m bench.packing --size 64" in text and result["commit"][:12] in text
    assert "| 4 | 3.25 |" in text and "| speed | 3.25 | >= 3 | met |" in text
    assert result["machine"]["cpu"] in text
    missing = render.section("scaling", render.load("scaling", tmp_path))
    assert "Not measured at a recorded commit yet: run `python -m bench.scaling" in missing


def test_a_variant_renders_beside_its_bench_not_instead(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench/log_gaps.py"])
    goals = [{"goal": "speed", "value": 3.25, "want": ">= 3", "verdict": "met"}]
    write_result(tmp_path / "docs/results/log_gaps", "log_gaps", [], goals)
    monkeypatch.setenv("LOWBIT_CPU_ISA", "avx2")
    missed = [{**goals[0], "value": 1.5, "verdict": "MISSED"}]
    write_result(tmp_path / "docs/results/log_gaps@avx2", "log_gaps", [], missed)
    assert render.variants("log_gaps", tmp_path) == ["avx2"]
    doc = render.render_doc(tmp_path)
    main, variant = doc.split("## `bench/log_gaps.py`")[1].split("### Variant `log_gaps@avx2`")
    assert "| speed | 3.25 | >= 3 | met |" in main and "| speed | 1.5 | >= 3 | MISSED |" in variant
    assert "LOWBIT_CPU_ISA=avx2" in variant and "LOWBIT_CPU_ISA" not in main
    block = render.render_block(tmp_path)
    main, variant = [line for line in block.split("\n") if "`bench/log_gaps.py`" in line]
    assert main.startswith("- `bench/log_gaps.py`, goals: speed: 3.25")
    assert variant.startswith("- `bench/log_gaps.py` (`@avx2`), goals: speed: 1.5 (want >= 3;")


def _doc_paths(doc: Path) -> list[tuple[str, Path]]:
    """(cited text, the file it must be) for every relative link and backticked repo path."""
    text = doc.read_text()
    found = []
    for target in LINK.findall(text):
        if not re.match(r"[a-z]+:|#", target):
            found.append((target, doc.parent / target.split("#")[0]))
    for quoted in BACKTICKED.findall(text):
        found += [(m, REPO / m) for m in PATH.findall(quoted.split("::")[0]) if m not in EXTERNAL]
    return found


def _docstring_paths(source: Path) -> list[tuple[str, Path]]:
    return [(m, REPO / m) for m in PATH.findall(source.read_text())]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_file_a_doc_links_to_exists(doc):
    missing = [cited for cited, path in _doc_paths(doc) if not path.exists()]
    assert not missing, f"{doc.relative_to(REPO)} cites files that do not exist: {missing}"


def test_every_repo_file_a_pipeline_docstring_cites_exists():
    missing = sorted(
        f"{src.relative_to(REPO)}: {cited}"
        for src in (REPO / "pipeline").rglob("*.py")
        for cited, path in _docstring_paths(src)
        if not path.exists()
    )
    assert not missing, f"pipeline/ cites files that do not exist: {missing}"


def test_the_path_check_finds_what_it_should(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "see `pipeline/config.py`, `conf/quant/<name>.yaml`, `outputs/x/eval.json`, "
        "`tests/test_io.py::test_x`, [a](sub/x.md#a), [b](https://x.org/a.md)"
    )
    cited = [text for text, _ in _doc_paths(doc)]
    assert cited == ["sub/x.md#a", "pipeline/config.py", "tests/test_io.py"]


def test_readme_names_the_mixed_recipes_candidates():
    candidates = yaml.safe_load((REPO / "conf/quant/mixed.yaml").read_text())["candidates"]
    readme = " ".join((REPO / "README.md").read_text().split())
    at = readme.index("mixed recipe")
    claim = re.split(r"\.(?:\s|$)", readme[at:], maxsplit=1)[0]
    named = FORMAT.findall(claim)
    count = re.search(rf"\b(\d+|{'|'.join(NUMBERS)})\b(?= (?:\w+ )?(?:candidates|formats))", claim)
    assert named or count, (
        f"README's mixed recipe names neither its formats nor their count: {claim}"
    )
    if named:
        assert sorted(named) == sorted(candidates), (
            f"README: {named}; conf/quant/mixed.yaml: {candidates}"
        )
    if count:
        n = int(count.group(1)) if count.group(1).isdigit() else NUMBERS[count.group(1)]
        assert n == len(candidates), (
            f"README says {n} candidates; conf/quant/mixed.yaml has {len(candidates)}"
        )
