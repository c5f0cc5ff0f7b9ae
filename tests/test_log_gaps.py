"""bench/log_gaps.py on synthetic logs: a run whose lines keep coming meets its goal, a silence
over the limit misses it and is shown with its lines, and a log without time stamps cannot be
checked (missed, unless ``--skip-goal`` leaves the goal out); each outcome in its exit status."""

from __future__ import annotations

from bench.log_gaps import main


def write_log(path, seconds_and_lines) -> None:
    """A log in lowbit's format, its records `seconds` after 12:00:00."""
    text = []
    for seconds, line in seconds_and_lines:
        if seconds is None:  # a line without a time stamp (a print, a traceback)
            text.append(line)
            continue
        m, s = divmod(seconds, 60)
        text.append(
            f"[2026-12-02 12:{int(m):02d}:{s:06.3f}".replace(".", ",") + f"][x][INFO] - {line}"
        )
    path.write_text("\n".join(text) + "\n")


def test_a_log_that_keeps_talking_meets_the_goal(tmp_path, capsys):
    log = tmp_path / "lowbit.log"
    write_log(
        log, [(0, "start"), (30, "step 10"), (None, "a print"), (85.5, "step 20"), (90, "end")]
    )
    assert main([str(log)]) == 0
    out = capsys.readouterr().out
    assert "| 55.5 |" in out and "every goal met" in out  # 30 s -> 85.5 s, the print in between


def test_a_silence_over_the_limit_misses_it_and_shows_where(tmp_path, capsys):
    log = tmp_path / "lowbit.log"
    write_log(log, [(0, "start"), (10, "training starts"), (100.25, "training done"), (101, "end")])
    assert main([str(log), "--context", "1"]) == 1
    out = capsys.readouterr().out
    assert "90.2 s of silence after line 2:" in out
    assert ">      2  " in out and "training starts" in out and "training done" in out
    assert "MISSED" in out
    assert main([str(log), "--max-gap", "95"]) == 0  # the goal is an argument


def test_a_run_dir_stands_for_its_newest_lowbit_log(tmp_path, capsys):
    log = tmp_path / "run" / ".hydra" / "2026-12-02_12-00-00" / "lowbit.log"
    log.parent.mkdir(parents=True)
    write_log(log, [(0, "a"), (61, "b")])
    assert main([str(tmp_path / "run")]) == 1
    assert str(log) in capsys.readouterr().out


def test_a_log_without_time_stamps_cannot_be_checked(tmp_path, capsys):
    log = tmp_path / "out.txt"
    log.write_text("Epoch 0: 100%|#####| 10/10\nTrainer.fit stopped\n")
    assert main([str(log)]) == 1
    assert "(not measured: fewer than two time-stamped records)" in capsys.readouterr().out
    write_log(log, [(0, "only one record")])
    assert main([str(log)]) == 1
    assert main([str(log), "--skip-goal", "longest gap", "--skip-goal", "span"]) == 0  # narrowed


def test_a_workflow_longer_than_the_readme_says_misses_the_span_goal(tmp_path, capsys):
    log = tmp_path / "lowbit.log"
    write_log(log, [(30 * i, f"step {i}") for i in range(22)])  # 630 s, never silent for 60
    assert main([str(log)]) == 1
    out = capsys.readouterr().out
    assert "| the log's span, first to last record, s | 630 | <= 600 | MISSED |" in out
    assert main([str(log), "--max-span", "0"]) == 0  # one stage's log: no span goal
