"""`lowbit-run`: prints the continuation; a corrupt artifact is an error naming the file."""

from __future__ import annotations

import pytest

from pipeline.export import export_artifact
from pipeline.runtime.cli import main, parse_args
from tests.export.models import export_options


@pytest.fixture(scope="module")
def artifact(qmodels, tmp_path_factory):
    art = tmp_path_factory.mktemp("cli") / "artifact"
    export_artifact(qmodels.get("int4g128"), art, export_options(), draft=qmodels.fp)
    return art


def test_prints_prompt_and_continuation(artifact, capsys):
    from pipeline.runtime import load

    rc = main(
        [
            str(artifact),
            "--prompt",
            "the quick",
            "--prompt",
            "a lazy dog",
            "--max-new-tokens",
            "6",
            "--stats",
            "--backend",
            "torch",
        ]
    )
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 2
    expected = load(artifact, "torch").generate("the quick", 6, speculative=False).text
    assert lines[0] == "the quick" + expected
    assert "tok/s" in err and "drafted tokens accepted" in err  # the artifact's draft was used
    assert "[kernels: " in err and "x7" in err  # what the quantized layers ran
    assert (
        main([str(artifact), "--prompt", "x", "--no-draft", "--max-new-tokens", "2", "--stats"])
        == 0
    )
    assert "drafted" not in capsys.readouterr().err


def test_corrupt_artifact_exits_with_message(artifact, tmp_path, capsys):
    import shutil

    bad = tmp_path / "a"
    shutil.copytree(artifact, bad)
    (bad / "config.json").write_text("{}")
    assert main([str(bad), "--prompt", "x"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_argument_errors():
    with pytest.raises(SystemExit):
        parse_args(["a"])  # --prompt is required
    with pytest.raises(SystemExit):
        parse_args(["a", "--prompt", "x", "--draft", "d", "--no-draft"])
    with pytest.raises(SystemExit):
        parse_args(["a", "--prompt", "x", "--temperature", "-1"])


def test_temperature_schedule_flag_reaches_the_runtime(artifact, monkeypatch, capsys):
    from pipeline.runtime.loader import Runtime

    seen = []
    real = Runtime.generate

    def spy(self, prompt, *args, **kwargs):
        seen.append(kwargs.get("temperature_schedule", False))
        kwargs.pop("temperature_schedule", None)  # the decoder's own test checks the schedule
        return real(self, prompt, *args, **kwargs)

    monkeypatch.setattr(Runtime, "generate", spy)
    base = [str(artifact), "--prompt", "x", "--max-new-tokens", "3", "--temperature", "0.8"]
    assert main(base) == 0 and main([*base, "--temperature-schedule"]) == 0
    assert seen == [False, True]
    assert parse_args(["a", "--prompt", "x"]).temperature_schedule is False


def run(artifact, capsys, *flags: str) -> tuple[int, str, str]:
    rc = main([str(artifact), "--prompt", "the quick", "--max-new-tokens", "8", *flags])
    out, err = capsys.readouterr()
    return rc, out, err


def test_transformers_generate_flags(artifact, capsys):
    rc, greedy, _ = run(artifact, capsys)
    assert rc == 0
    # top-k 1 sampling is greedy; streaming prints the line the plain run prints
    assert run(artifact, capsys, "--temperature", "1", "--top-k", "1")[:2] == (0, greedy)
    assert run(artifact, capsys, "--stream")[:2] == (0, greedy)
    # a stop string (the greedy text's 5th and 6th new characters) ends the output
    stop = greedy[len("the quick") :][4:6]
    rc, out, _ = run(artifact, capsys, "--stop", stop, "--stream", "--no-draft")
    cut = greedy[: greedy.index(stop, len("the quick")) + 2]
    assert rc == 0 and out == cut + "\n" and len(cut) < len(greedy) - 1


def test_chat_without_template_exits_with_message(artifact, capsys):
    rc, _, err = run(artifact, capsys, "--chat")
    assert rc == 2 and "no chat template" in err


@pytest.mark.parametrize(
    "flags",
    [["--top-k", "3"], ["--temperature", "1", "--top-p", "0"], ["--stop", "x", "--gamma", "2"]],
)
def test_transformers_generate_flag_errors(flags):
    with pytest.raises(SystemExit):
        parse_args(["a", "--prompt", "x", *flags])
