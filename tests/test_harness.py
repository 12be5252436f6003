"""Harness episodes end to end: `rollway up` with an external agent program (examples/agent_program.py
and tiny programs) playing toy tasks inside the local jail, through the worker's gateway. Real broker,
real bubblewrap jail, real gateway; the scripted policy is the only fake (it is the model)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT
from jobs import run_with_progress

pytestmark = pytest.mark.e2e
ROLLWAY = [sys.executable, "-m", "rollway.runners"]

SHELL_CALL = '<tool_call>{{"name": "shell", "arguments": {{"command": "{}"}}}}</tool_call>'
FIX = [  # the first two calls extend one stream; then agent_program.py compacts its history
    {"when": "Summary:", "turns": ["unused", "The sum is in answer.txt."]},
    {"when": "", "turns": [SHELL_CALL.format("cat numbers.txt"),
                           SHELL_CALL.format("awk '{print $1 + $2}' numbers.txt > answer.txt")]},
]
NON_FIX = [{"when": "", "turns": ["I cannot do this."]}]


def harness_job(tmp_path, script: list[dict], harness: dict, count: int = 2, **agent) -> dict:
    # The run outlasts the episode deadline, which outlasts the program's own time limit.
    deadline = max(300, harness.get("time_limit_s", 0) + 60)
    job = {
        "run": {"name": "harness", "timeout_s": deadline + 60},
        "tasks": {"type": "toy", "count": count},
        "scheduler": {"group_size": 1, "max_inflight_episodes": 2, "episode_deadline_s": deadline, "max_attempts": 2},
        "agent": {"concurrency": 2, "harness": harness, **agent},
        "policy": {"type": "scripted", "chat_format": "bytes-chatml", "script": script},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return job


def up(tmp_path, script: list[dict], harness: dict, count: int = 2) -> tuple[subprocess.CompletedProcess, dict, list[dict]]:
    job = harness_job(tmp_path, script, harness, count)
    run_dir = tmp_path / "run"
    out = subprocess.run([*ROLLWAY, "up", "--no-report", str(tmp_path / "job.yaml"), "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=job["run"]["timeout_s"] + 60, cwd=ROOT)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    trajs_file = run_dir / "trajectories.jsonl"
    trajs = [json.loads(line) for line in trajs_file.read_text().splitlines()] if trajs_file.exists() else []
    return out, summary, trajs


AGENT_PROGRAM = {"command": ["python3", f"{ROOT}/examples/agent_program.py", "{instruction}"],
                 "install": {"type": "host_dir", "path": str(ROOT / "examples")}}


def test_agent_program_fixes_toy_tasks_and_its_tokens_are_what_the_engine_sampled(tmp_path):
    from rollway.policies.config import ScriptedPolicyConfig
    from rollway.policies.factory import build_chat_format
    from rollway.policies.scripted import SCRIPTED_LOGPROB

    out, summary, trajs = up(tmp_path, FIX, AGENT_PROGRAM)
    assert out.returncode == 0, out.stderr[-3000:]
    assert summary["episodes_completed"] == 2 and summary["episodes_failed"] == 0
    assert len(trajs) == 2
    # The same learner stage as built-in episodes received them (it trains only with a trainable policy).
    assert json.loads((tmp_path / "run" / "learner-status.json").read_text())["episodes_received"] == 2
    chat = build_chat_format(ScriptedPolicyConfig(script=FIX))
    for t in trajs:
        assert t["resolved"] and t["reward"] == 1.0, t["grade"]
        assert t["stop_reason"] == "harness_exit"
        # Three calls: two in the first stream, the third after the program compacted its history.
        assert t["num_turns"] == 3 and len(t["segment_starts"]) == 1
        assert t["turns"][2]["segment_reason"] == "history_rewritten"
        # The scripted engine returns encode(text) + the stop token, each with SCRIPTED_LOGPROB.
        expected = [FIX[1]["turns"][0], FIX[1]["turns"][1], FIX[0]["turns"][1]]
        returned = [chat.encode(text) + list(chat.stop_token_ids[:1]) for text in expected]
        assert [t["token_ids"][s:e] for s, e in t["turn_spans"]] == returned
        assert [t["logprobs"][s:e] for s, e in t["turn_spans"]] == [[SCRIPTED_LOGPROB] * len(r) for r in returned]
        assert [turn["completion_ids"] for turn in t["turns"]] == returned
        assert sum(t["loss_mask"]) == sum(e - s for s, e in t["turn_spans"])
        # The second stream is the whole prompt of the compacted call, not a suffix of the first.
        start = t["segment_starts"][0]
        assert "Summary:" in chat.decode(t["token_ids"][start:t["turn_spans"][2][0]])


def test_a_program_that_gives_up_is_graded_unresolved(tmp_path):
    out, summary, trajs = up(tmp_path, NON_FIX, AGENT_PROGRAM)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(trajs) == 2
    assert all(not t["resolved"] and t["reward"] == 0.0 and t["stop_reason"] == "harness_exit" for t in trajs)
    assert all(t["num_turns"] == 1 and t["segment_starts"] == [] for t in trajs)


def agent_failures_graded(tmp_path, summary: dict, trajs: list[dict], kind: str, count: int = 2) -> None:
    """Every episode came back graded 0 for its failure (base/blame.py), was not retried, and reached the
    learner; the summary counts it as graded, by its failure's kind, never as failed."""
    failures_file = tmp_path / "run" / "failures.jsonl"
    failures = failures_file.read_text() if failures_file.exists() else ""
    assert len(trajs) == count, failures[-3000:]
    assert failures == ""  # no attempt failed: nothing retried, nothing given up
    for t in trajs:
        assert t["reward"] == 0.0 and not t["resolved"] and t["stop_reason"] == "agent_failure", t["grade"]
        assert t["grade"]["outcome"] == "agent_failure" and t["grade"]["failure_kind"] == kind, t["grade"]
        assert t["grade"]["failure_stage"] in ("agent", "reward") and t["grade"]["failure"]
        assert t["episode"]["attempt"] == 0
        # A valid token-exact trajectory: one mask entry and one logprob slot per token, spans inside it.
        assert len(t["token_ids"]) == len(t["loss_mask"]) == len(t["logprobs"]) and t["num_turns"] >= 1
        assert sum(t["loss_mask"]) == sum(e - s for s, e in t["turn_spans"])
    assert summary["episodes_completed"] == count and summary["episodes_failed"] == 0
    assert summary["episodes_retried"] == 0
    assert sum(summary["graded_failures"].values()) == count, summary["graded_failures"]
    assert json.loads((tmp_path / "run" / "learner-status.json").read_text())["episodes_received"] == count


def test_a_crashing_program_is_graded_0_with_its_exit_code_and_output(tmp_path):
    """A program that exits non-zero on its own has run the agent's code: its failure is the agent's,
    graded 0 with the exit code and output as the reason, and trained on (never retried, never dropped).
    An episode whose program made no call is one empty turn on the task's prompt."""
    crash = {"command": ["python3", "-c", "import sys; print('disk on fire'); sys.exit(3)"]}
    out, summary, trajs = up(tmp_path, NON_FIX, crash)
    assert out.returncode == 0, out.stderr[-3000:]
    agent_failures_graded(tmp_path, summary, trajs, "HarnessCrashed")
    for t in trajs:
        assert "exited with code 3" in t["grade"]["failure"] and "disk on fire" in t["grade"]["failure"]
        assert t["num_turns"] == 1 and t["turn_spans"] == [[t["prompt_length"], t["prompt_length"]]]
    assert summary["graded_failures"] == {"agent: HarnessCrashed": 2}


KILL_ALL = [{"when": "", "turns": [SHELL_CALL.format("kill -9 -1")]}]


def test_a_model_that_has_its_program_kill_everything_is_graded_0_not_retried(tmp_path):
    """The attack of issue 39: the model makes the agent program run `kill -9 -1`, which kills the program
    (exit 137). That used to be a retryable crash: every episode was retried, then dropped, never trained
    on, while a model that gave up politely got its 0. Now it is the model's 0, with the reason, and the
    call that did it is in the trajectory (its tokens trained on with reward 0)."""
    from rollway.policies.config import ScriptedPolicyConfig
    from rollway.policies.factory import build_chat_format

    out, summary, trajs = up(tmp_path, KILL_ALL, AGENT_PROGRAM)
    assert out.returncode == 0, out.stderr[-3000:]
    agent_failures_graded(tmp_path, summary, trajs, "HarnessCrashed")
    chat = build_chat_format(ScriptedPolicyConfig(script=KILL_ALL))
    for t in trajs:
        assert "exited with code" in t["grade"]["failure"]
        assert t["num_turns"] == 1
        [(start, end)] = t["turn_spans"]
        assert chat.decode(t["token_ids"][start:end]).startswith(KILL_ALL[0]["turns"][0])


def test_a_program_that_never_exits_stops_at_the_time_limit(tmp_path):
    sleeper = {"command": ["python3", "-c", "import time; time.sleep(3600)"], "time_limit_s": 3,
               "silence_limit_s": 600}
    out, summary, trajs = up(tmp_path, NON_FIX, sleeper)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(trajs) == 2
    assert all(t["stop_reason"] == "harness_time_limit" and not t["resolved"] for t in trajs)


def test_a_silent_program_stops_at_the_silence_limit(tmp_path):
    sleeper = {"command": ["python3", "-c", "import time; time.sleep(3600)"], "time_limit_s": 200,
               "silence_limit_s": 2}
    out, summary, trajs = up(tmp_path, NON_FIX, sleeper)
    assert out.returncode == 0, out.stderr[-3000:]
    assert all(t["stop_reason"] == "harness_silence" for t in trajs) and len(trajs) == 2


def test_a_call_the_engine_is_slow_to_answer_is_not_the_programs_silence(tmp_path):
    """The engine answers the program's second call after 20 s (the scripted model behind a wait: a stand-in
    for an engine under load; the only fake) and the silence limit is 15 s (room for the program's start on a
    busy machine). A program that makes two calls and exits is waiting on the engine, not silent: it ends
    `harness_exit` with both calls. Before, the clock ran while a call was being
    served: `harness_silence`, graded as it stands, a 0 the infrastructure caused. A program silent between
    its calls still stops (test above). Real gateway, bubblewrap jail and program, in one process."""
    import asyncio

    from test_harness_chaos import CALLER

    from rollway.actors.harness import HarnessRunner, KeepingRecorder
    from rollway.gateway import Gateway, MemoryRecorder
    from rollway.gateway.config import HarnessConfig
    from rollway.policies.base import InferenceClient
    from rollway.policies.config import ScriptedPolicyConfig
    from rollway.policies.factory import build_chat_format, build_inference
    from rollway.sandboxes.base import SandboxSpec
    from rollway.sandboxes.config import SandboxConfig
    from rollway.sandboxes.local import LocalSandboxProvider
    from rollway.schemas.messages import EpisodeKey

    policy = ScriptedPolicyConfig(script=[{"when": "", "turns": ["ok"]}])
    chat = build_chat_format(policy)

    class Slow(InferenceClient):
        def __init__(self):
            self.inner, self.calls = build_inference(policy, chat), 0

        async def generate(self, prompt_ids, params):
            self.calls += 1
            if self.calls == 2:
                await asyncio.sleep(20.0)
            return await self.inner.generate(prompt_ids, params)

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "README.md").write_text("demo\n")

    async def main():
        recorder = KeepingRecorder(MemoryRecorder())
        gateway = Gateway(Slow(), chat, recorder)
        await gateway.start()
        runner = HarnessRunner(HarnessConfig(command=["python3", "-c", CALLER, "2", "0", "hello"], time_limit_s=120,
                                             silence_limit_s=15), gateway, recorder)
        box = await LocalSandboxProvider(SandboxConfig(root=str(tmp_path / "boxes"))).create(
            SandboxSpec(source_dir=str(tmp_path / "src")), "slow")
        try:
            return await runner.play(EpisodeKey(episode_id="r-slow-g0-s0", group_id="g0", task_id="t"), "go", box, [])
        finally:
            await box.destroy()
            await runner.close()

    outcome = asyncio.run(main())
    assert outcome.stop_reason == "harness_exit" and len(outcome.turns) == 2, (outcome.stop_reason, outcome.failure)

PROBE = r"""
import json, os, socket, sys, urllib.request
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/models",
                             headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
models = json.load(urllib.request.urlopen(req, timeout=10))
reached = []
for host in sys.argv[2:]:
    try:
        socket.create_connection((host, int(sys.argv[1])), timeout=5).close()
        reached.append(host)
    except OSError:
        pass
print("models", [m["id"] for m in models["data"]], "reached", reached)
sys.exit(0 if models["data"] and not reached else 5)
"""


def test_the_sandbox_reaches_the_gateway_and_nothing_else(tmp_path):
    """The program asks the gateway for its models (through the forwarder), then tries a listener this
    test opens on every host address; it exits 5 (failing the attempt) if the gateway did not answer or
    the listener was reached."""
    import socket
    import threading

    listener = socket.create_server(("0.0.0.0", 0))
    port = listener.getsockname()[1]
    accepted: list[object] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    hosts = ["127.0.0.1", *subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()]
    assert len(hosts) > 1, "this host has no address besides loopback to probe"
    # The probe itself: the host can reach the listener (so a jail that could would be caught).
    socket.create_connection((hosts[1], port), timeout=5).close()
    try:
        probe = {"command": ["python3", "-c", PROBE, str(port), *hosts]}
        out, summary, trajs = up(tmp_path, NON_FIX, probe)
    finally:
        listener.close()
    assert out.returncode == 0, out.stderr[-3000:]
    failures = tmp_path / "run" / "failures.jsonl"
    assert not failures.exists() or not failures.read_text().strip(), failures.read_text()
    assert len(trajs) == 2 and all(t["stop_reason"] == "harness_exit" for t in trajs)
    assert len(accepted) == 1  # only the host's own check above


def test_a_program_past_its_call_limit_ends_with_the_call_limit(tmp_path):
    """agent_program.py's third call is refused (409); the program then exits non-zero, which is the
    limit's doing, not a crash."""
    out, summary, trajs = up(tmp_path, FIX, {**AGENT_PROGRAM, "max_calls": 2})
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(trajs) == 2
    assert all(t["stop_reason"] == "harness_call_limit" and t["num_turns"] == 2 for t in trajs)


@pytest.mark.parametrize("command", [
    ["sh", "-c", "grep -q numbers.txt {instruction_file} && awk '{print $1 + $2}' numbers.txt > answer.txt"],
    ["sh", "-c", "grep -q numbers.txt && awk '{print $1 + $2}' numbers.txt > answer.txt"],  # stdin
], ids=["instruction_file", "stdin"])
def test_the_instruction_reaches_the_program_by_file_or_stdin(tmp_path, command):
    """A program that makes no model call: it solves the task only if it read the instruction."""
    out, summary, trajs = up(tmp_path, NON_FIX, {"command": command})
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(trajs) == 2 and all(t["resolved"] and t["stop_reason"] == "harness_exit" for t in trajs)


MINI_ACTION = "THOUGHT: {}\n\n```mswea_bash_command\n{}\n```"
MINI_FIX = [  # mini-swe-agent's observations are user messages: the script keys on what the prompt holds
    {"when": "<returncode>0</returncode>", "turns": [MINI_ACTION.format("Done.", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")]},
    {"when": "", "turns": [MINI_ACTION.format("Add them.", "awk '{print $1 + $2}' numbers.txt > answer.txt")]},
]
MINI_NON_FIX = [{"when": "", "turns": [MINI_ACTION.format("Nothing to do.", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")]}]


def mini_harness() -> dict:
    from agent_programs import mini_harness, mini_swe_agent

    # Installed by scripts/setup-agents.sh (run here when missing: a failure, never a skip). Its start-up,
    # before the first call, counts as silence: importing litellm alone takes about 6 s of CPU, and 11-64 s
    # of wall time was measured in the jail on this 2-core machine at load 10-16 (a run at load 33 was
    # reported to end harness_silence under the default 120 s limit). So the limits here are ones a slow
    # machine does not cross; the silence and time limits themselves are tested above with programs
    # that never call.
    return {**mini_harness(mini_swe_agent()), "time_limit_s": 420, "silence_limit_s": 420}


@pytest.mark.parametrize(("script", "resolved"), [(MINI_FIX, True), (MINI_NON_FIX, False)], ids=["fix", "non_fix"])
def test_mini_swe_agent_plays_toy_tasks_in_its_text_format(tmp_path, script, resolved):
    from agent_programs import assert_captured_tokens

    out, summary, trajs = up(tmp_path, script, mini_harness(), count=1)  # its start-up costs seconds of CPU
    assert out.returncode == 0, out.stderr[-3000:]
    failures = tmp_path / "run" / "failures.jsonl"
    assert len(trajs) == 1, failures.read_text()[-3000:] if failures.exists() else out.stderr[-3000:]
    assert [(t["resolved"], t["stop_reason"], t["num_turns"]) for t in trajs] == [
        (resolved, "harness_exit", 2 if resolved else 1)]
    texts = [MINI_FIX[1]["turns"][0], MINI_FIX[0]["turns"][0]] if resolved else [MINI_NON_FIX[0]["turns"][0]]
    for t in trajs:
        assert_captured_tokens(t, texts, prompt_has=["mswea_bash_command", "numbers.txt"])


def test_calls_with_retries_and_a_rewrite_become_turns_that_reassemble_each_segment_exactly():
    """The mapping from captured calls to turns (actors/harness.py), on calls a real gateway recorded in
    memory: retried calls count once, a rewritten history opens a segment, and the reward stage's
    assembly of the turns gives back each segment's tokens, mask and logprobs in order."""
    import asyncio

    from test_gateway import SHELL, LoggedEngine, Program, _DictProgram, client_for, key, serve

    from rollway.episode.calls import outcome_of
    from rollway.episode.stream import TokenStream
    from rollway.gateway import rebuild_segments

    async def scenario():
        engine = LoggedEngine()
        gateway, recorder = await serve(engine)
        handle = gateway.open_episode(key())
        program = _DictProgram(Program(client_for(gateway, handle)))
        try:
            messages = [{"role": "user", "content": "What does a.txt say?"}]
            first = await program.call(messages, [SHELL])
            messages += [first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "a.txt"}]
            await program.call(messages, [SHELL])
            await program.call(messages, [SHELL])  # the same call again (a client timeout)
            await program.call([{"role": "user", "content": "Summary: a.txt exists. What does it say?"}], [SHELL])
        finally:
            await gateway.stop()
        return recorder.of("ep-1")

    calls = asyncio.run(scenario())
    assert [(c.retry_of, c.segment_reason) for c in calls] == [(None, "start"), (None, None), (1, None),
                                                               (None, "history_rewritten")]
    segments = rebuild_segments(calls)
    outcome = outcome_of(list(reversed(calls)), "harness_exit", [])  # any order, as the log may give them
    assert len(outcome.turns) == 3 and [t.turn for t in outcome.turns] == [0, 1, 2]
    assert [t.segment_reason for t in outcome.turns] == [None, None, "history_rewritten"]
    stream = TokenStream.of(outcome.prompt_ids, outcome.turns)
    assert stream.segment_starts == [len(segments[0].token_ids)]
    assert stream.token_ids == segments[0].token_ids + segments[1].token_ids
    assert stream.loss_mask == segments[0].loss_mask + segments[1].loss_mask
    assert stream.logprobs == segments[0].logprobs + segments[1].logprobs
    assert outcome.messages == [{"role": "user", "content": "What does a.txt say?"}]


def docker_up(tmp_path, harness: dict, script: list[dict] = NON_FIX) -> tuple[subprocess.CompletedProcess, dict, list[dict]]:
    from docker_engine import ensure_engine

    ensure_engine()
    job = harness_job(tmp_path, script, harness)
    job["sandbox"] = {"type": "docker", "image": "rollway-sandbox:bookworm",
                      "gateway_root": str(tmp_path / "gateway")}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    run_dir = tmp_path / "run"
    out = run_with_progress([*ROLLWAY, "up", "--no-report", str(tmp_path / "job.yaml"), "--run-dir", str(run_dir)],
                         cwd=ROOT)
    trajs_file = run_dir / "trajectories.jsonl"
    trajs = [json.loads(line) for line in trajs_file.read_text().splitlines()] if trajs_file.exists() else []
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    return out, summary, trajs


def test_in_a_docker_container_a_program_that_kills_everything_is_graded_0(tmp_path):
    """`kill -9 -1` as the program, in a container: every process of the sandbox user dies (the exec
    wrapper's shell too). The agent's failure: graded 0 and trained on, never retried."""
    out, summary, trajs = docker_up(tmp_path, {"command": ["sh", "-c", "echo bye; kill -9 -1"]})
    assert out.returncode == 0, out.stderr[-3000:]
    agent_failures_graded(tmp_path, summary, trajs, "HarnessCrashed")


def test_in_a_docker_container_the_program_reaches_the_gateway_and_nothing_else(tmp_path):
    """As the jail test, with the episode's sandbox a container (network none): the gateway answers
    through the socket folder bound into it; no host address (docker's bridge included) is reached."""
    import socket

    listener = socket.create_server(("0.0.0.0", 0))
    port = listener.getsockname()[1]
    hosts = ["127.0.0.1", *subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()]
    try:
        probe = {"command": ["python3", "-c", PROBE, str(port), *hosts]}
        out, _, trajs = docker_up(tmp_path, probe)
    finally:
        listener.close()
    failures = tmp_path / "run" / "failures.jsonl"
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(trajs) == 2, failures.read_text()[-3000:] if failures.exists() else out.stderr[-3000:]
    assert all(t["stop_reason"] == "harness_exit" for t in trajs)
    assert list((tmp_path / "gateway").iterdir()) == []  # each container's socket folder went with it


def test_in_a_docker_container_a_silent_program_is_stopped_and_the_task_graded(tmp_path):
    """The program solves the task from its instruction file, then hangs: the silence limit ends it
    (killed inside the container) and the grade is right."""
    solve = {"command": ["sh", "-c", "grep -q numbers.txt {instruction_file} && "
                                     "awk '{print $1 + $2}' numbers.txt > answer.txt && sleep 3600"],
             "silence_limit_s": 3}
    out, _, trajs = docker_up(tmp_path, solve)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(trajs) == 2 and all(t["stop_reason"] == "harness_silence" and t["resolved"] for t in trajs)


@pytest.mark.parametrize(("harness", "sandbox", "message"), [
    ({"command": []}, {}, "agent.harness.command"),
    ({"command": ["  "]}, {}, r"command\[0\] must name the program"),
    ({"command": ["x"], "install": {"type": "host_dir"}}, {}, "install.path must name a host folder"),
    ({"command": ["x"], "install": {"type": "host_dir", "path": "/no/such/folder"}}, {}, "is not a folder"),
    ({"command": ["x"], "install": {"type": "image", "path": "/usr"}}, {}, "only read with install.type=host_dir"),
    ({"command": ["x"], "install": {"type": "host_dir", "path": "/usr"}}, {"type": "sim"}, "needs sandbox.type=local or docker"),
    ({"command": ["x"], "max_calls": 0}, {}, "max_calls"),
    ({"command": ["x"], "silence": 3}, {}, "silence"),
    ({"command": ["x"], "time_limit_s": 300}, {}, "time_limit_s=300 must be under scheduler.episode_deadline_s=300"),
])
def test_bad_harness_config_is_refused_naming_what_to_fix(harness, sandbox, message):
    from pydantic import ValidationError

    from rollway.config.run import RunConfig

    with pytest.raises(ValidationError, match=message):
        RunConfig.model_validate({"agent": {"harness": harness}, "sandbox": sandbox})


def test_a_relative_install_path_is_taken_from_the_start_folder_and_fills_install_path(monkeypatch):
    """examples/chaos-harness.yaml names `examples` relative to the repository: every stage process
    starts in the same folder, so each resolves it to the same absolute path."""
    from rollway.config.run import RunConfig

    monkeypatch.chdir(ROOT)
    cfg = RunConfig.model_validate({"agent": {"harness": {"command": ["python3", "{install_path}/agent_program.py",
                                                                     "{instruction}"],
                                                          "install": {"type": "host_dir", "path": "examples"}}}})
    harness = cfg.agent.harness
    assert harness.install.path == str(ROOT / "examples") and harness.install.path in cfg.sandbox.ro_binds
    assert harness.argv("say {install_path}") == ["python3", f"{ROOT}/examples/agent_program.py", "say {install_path}"]
    assert not harness.stdin_instruction


def test_harness_config_binds_its_host_folder_and_gives_containers_a_socket_folder():
    from rollway.config.run import RunConfig

    local = RunConfig.model_validate({"agent": {"harness": {"command": ["x"], "install": {
        "type": "host_dir", "path": str(ROOT / "examples")}}}})
    assert str(ROOT / "examples") in local.sandbox.ro_binds
    docker = RunConfig.model_validate({"agent": {"harness": {"command": ["x"]}}, "sandbox": {"type": "docker"}})
    assert docker.sandbox.gateway_root == "/tmp/rollway-gateway"
    assert RunConfig.model_validate({"sandbox": {"type": "docker"}}).sandbox.gateway_root is None


def test_a_host_folder_install_is_bound_read_only_into_each_docker_container():
    """`install.type: host_dir` with docker: the folder (say a node runtime and Qwen Code) appears
    read-only at the same path in every episode's container, beside the gateway's socket folder."""
    from rollway.config.run import RunConfig
    from rollway.sandboxes.docker import DockerSandboxProvider

    cfg = RunConfig.model_validate({"agent": {"harness": {"command": ["x"], "install": {
        "type": "host_dir", "path": str(ROOT / "examples")}}}, "sandbox": {"type": "docker"}})
    assert cfg.sandbox.ro_binds == [str(ROOT / "examples")]
    provider = DockerSandboxProvider.__new__(DockerSandboxProvider)  # no engine needed to read the options
    provider.config = cfg.sandbox
    volumes = provider.container_options("harness-ro-1")["volumes"]
    assert volumes[str(ROOT / "examples")] == {"bind": str(ROOT / "examples"), "mode": "ro"}


def test_a_task_whose_rollway_folder_is_a_link_gets_no_gateway_socket_outside_its_workspace(tmp_path):
    """Task files are data: a `.rollway` link in the task's folder must not make the gateway (root)
    bind its socket where the link points on the host."""
    import asyncio

    from rollway.actors.harness import gateway_socket
    from rollway.sandboxes.base import SandboxError, SandboxSpec
    from rollway.sandboxes.config import LocalSandboxConfig
    from rollway.sandboxes.local import LocalSandboxProvider

    source, outside = tmp_path / "task", tmp_path / "outside"
    source.mkdir()
    outside.mkdir()
    (source / "numbers.txt").write_text("1 2\n")
    (source / ".rollway").symlink_to(outside)
    provider = LocalSandboxProvider(LocalSandboxConfig(root=str(tmp_path / "boxes")))

    async def scenario() -> None:
        sandbox = await provider.create(SandboxSpec(source_dir=str(source)), "harness-link-1")
        try:
            with pytest.raises(SandboxError, match="not a plain folder"):
                await gateway_socket(sandbox)
        finally:
            await sandbox.destroy()

    asyncio.run(scenario())
    assert list(outside.iterdir()) == []
