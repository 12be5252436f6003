"""`rollway show`: episodes turn by turn from a run folder and from the trajectories topic."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.e2e


@pytest.fixture
def show(capsys, monkeypatch):
    """`rollway show ARGS` in this process (the CLI as users call it, without a second interpreter)."""
    from rollway.runners.cli import main

    monkeypatch.setenv("COLUMNS", "140")

    def run(*args: str) -> SimpleNamespace:
        code = main(["show", *args])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return run


def episodes(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "trajectories.jsonl").read_text().splitlines()]


def test_show_lists_episodes_and_renders_the_first_turn_by_turn(smoke_run, show):
    out = show(str(smoke_run.run_dir))
    assert out.returncode == 0, out.stderr
    trajs = episodes(smoke_run.run_dir)
    assert "8 episodes" in out.stdout
    assert all(t["episode"]["episode_id"] in out.stdout for t in trajs)
    for text in ("model output", "tool call: bash", '{"command": "cat numbers.txt"}', "observation",
                 "Exit code: 0", "turn 3", "stop reason", "finish", "reward", "stages", "init_queue", "agent_queue"):
        assert text in out.stdout, text


def test_show_one_episode_as_html(smoke_run, show, tmp_path):
    t = episodes(smoke_run.run_dir)[3]
    out = show(str(smoke_run.run_dir), "--episode", t["episode"]["episode_id"], "--html", str(tmp_path / "ep.html"))
    assert out.returncode == 0, out.stderr
    html = (tmp_path / "ep.html").read_text()
    assert html.lstrip().lower().startswith("<!doctype html") and t["episode"]["episode_id"] in html
    answer = str(t["grade"]["expected"])
    assert "numbers.txt" in html and answer in html and "8 episodes" not in html


def test_show_reads_episodes_from_the_topic(smoke_run, show):
    t = episodes(smoke_run.run_dir)[-1]
    out = show("--bootstrap", smoke_run.bootstrap, "--topic-prefix", smoke_run.prefix, "--episode", t["episode"]["episode_id"])
    assert out.returncode == 0, out.stderr
    assert t["episode"]["episode_id"] in out.stdout and "tool call: finish" in out.stdout
    out = show("--bootstrap", smoke_run.bootstrap, "--topic-prefix", smoke_run.prefix)
    assert out.returncode == 0 and "8 episodes" in out.stdout


def test_show_names_a_missing_episode(smoke_run, show):
    out = show(str(smoke_run.run_dir), "--episode", "nope")
    assert out.returncode == 2 and "episode 'nope' is not in" in out.stderr


def test_show_displays_the_simulated_users_messages():
    """A task set's simulated user speaks after a turn (`user_message`); show printed every other part
    of the turn but not that."""
    from rich.console import Console

    from rollway.reports.show import turn_panel

    turn = {"turn": 0, "policy_version": 0, "finish_reason": "stop", "assistant_text": "What is your order?",
            "observations": [], "hints": [], "user_message": "It's order A-17."}
    console = Console(width=100, record=True)
    console.print(turn_panel(turn, 2000))
    text = console.export_text()
    assert "What is your order?" in text and "It's order A-17." in text and "user" in text


HOSTILE = "\x1b[2J\x1b]52;c;cm0gLXJmIH4=\x07\x1b]0;pwned\x07\rhidden\x9b31m"
"""A clear-screen, a clipboard write (OSC 52), a title change, a carriage return and an 8-bit CSI."""


def test_show_prints_what_the_model_and_its_tools_wrote_without_terminal_controls(smoke_run, show, tmp_path):
    """The model's output, a tool's output, a tool name the model chose and a task id reach the terminal in
    `rollway show`: rich passes escape sequences through, so a model could clear the operator's screen,
    rewrite lines or set the clipboard. Every control character but newline and tab is shown escaped."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(smoke_run.run_dir, run_dir)
    trajs = episodes(run_dir)
    t = trajs[0]
    t["episode"]["task_id"] += HOSTILE
    turn = t["turns"][0]
    turn["assistant_text"] += HOSTILE
    turn["observations"][0]["content"] += HOSTILE
    turn["observations"][0]["tool"] = "bash" + HOSTILE
    turn["observations"][0]["arguments"] = {"command" + HOSTILE: "ls"}  # a key the model chose
    (run_dir / "trajectories.jsonl").write_text("".join(json.dumps(x) + "\n" for x in trajs))
    for args in ((str(run_dir),), (str(run_dir), "--episode", t["episode"]["episode_id"])):
        out = show(*args)
        assert out.returncode == 0, out.stderr
        assert not any(c in out.stdout for c in "\x1b\x07\r\x9b"), repr(out.stdout[-600:])
        assert "\\x1b]52;c;cm0gLXJmIH4=" in out.stdout and "\\x9b31m" in out.stdout  # shown, escaped
