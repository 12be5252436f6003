"""Harness episodes when the process serving the gateway dies or an attempt ends early: the trained
trajectory holds each captured call once, and only calls of its own attempt. Real bubblewrap jail,
real gateway, real broker (the embedded Tansu of the session) and `rollway chaos`; the scripted
policy is the only fake (it is the model)."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import uuid

import pytest
from conftest import ROOT
from jobs import run_with_progress

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

# A program that makes `calls` chat calls through the gateway (stdlib only), opening with `word`, then
# exits with `code` (or, given a fifth argument, waits to be stopped).
CALLER = r"""
import json, os, sys, time, urllib.request
calls, code, word = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
messages = [{"role": "user", "content": word}]
for _ in range(calls):
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", method="POST",
        data=json.dumps({"model": "m", "messages": messages}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    reply = json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["message"]
    messages += [{"role": "assistant", "content": reply["content"]}, {"role": "user", "content": "again"}]
if len(sys.argv) > 4:
    time.sleep(600)
sys.exit(code)
"""


def _harness(calls: int, code: int, word: str, wait: bool = False):
    from rollway.gateway.config import HarnessConfig

    return HarnessConfig(command=["python3", "-c", CALLER, str(calls), str(code), word, *(["wait"] if wait else [])],
                         time_limit_s=60, silence_limit_s=60)


@pytest.mark.broker
@pytest.mark.parametrize("ending", ["crash", "cancelled"])
def test_a_later_attempt_on_the_same_worker_gets_only_its_own_calls(tmp_path, broker, topic_prefix, ending):
    """Attempt 0 records 3 calls and then crashes (graded 0 with those calls) or its handler is cancelled
    (as on a rebalance);
    attempt 1 of the same episode, on the same worker's gateway, makes 2 calls. Its outcome must be
    its own 2 calls: before, the worker kept acknowledged calls by episode id and dropped them only
    when an attempt ended normally, so attempt 1 was built from attempt 0's calls."""
    from rollway.actors.harness import HarnessRunner, KeepingRecorder
    from rollway.config.run import RunConfig
    from rollway.gateway.recorder import KafkaRecorder
    from rollway.gateway.server import Gateway
    from rollway.policies.config import ScriptedPolicyConfig
    from rollway.policies.factory import build_chat_format, build_inference
    from rollway.sandboxes.config import SandboxConfig
    from rollway.sandboxes.local import LocalSandboxProvider
    from rollway.schemas.messages import EpisodeKey

    source = tmp_path / "src"
    source.mkdir()
    (source / "README.md").write_text("demo\n")
    # Attempt 0's program opens with "first" and is answered "dead"; attempt 1's is answered "live".
    policy = ScriptedPolicyConfig(script=[{"when": "first", "turns": ["dead"]}, {"when": "", "turns": ["live"]}])
    chat = build_chat_format(policy)
    cfg = RunConfig.model_validate({"topics": {"prefix": topic_prefix}})

    async def main():
        from rollway.sandboxes.base import SandboxSpec

        provider = LocalSandboxProvider(SandboxConfig(root=str(tmp_path / "boxes")))
        recorder = KeepingRecorder(await KafkaRecorder.connect(cfg.broker, cfg.topics, broker.bootstrap))
        gateway = Gateway(build_inference(policy, chat), chat, recorder)
        await gateway.start()
        first = HarnessRunner(_harness(3, 3, "first"), gateway, recorder)
        again = HarnessRunner(_harness(2, 0, "second"), gateway, recorder)
        key = EpisodeKey(episode_id=f"r-{uuid.uuid4().hex[:6]}-g0-s0", group_id="g0", task_id="t")
        try:
            box0 = await provider.create(SandboxSpec(source_dir=str(source)), "a0")
            if ending == "crash":  # the agent's failure: graded 0 with attempt 0's own calls
                crashed = await first.play(key, "count", box0, [])
                assert crashed.failure["failure_kind"] == "HarnessCrashed", crashed.failure
                assert "exited with code 3" in crashed.failure["failure"]
                assert [(t.call_attempt, t.call_index) for t in crashed.turns] == [(0, 0), (0, 1), (0, 2)]
            else:
                play = asyncio.create_task(HarnessRunner(_harness(3, 0, "first", wait=True), gateway, recorder).play(
                    key, "count", box0, []))
                while len(recorder.kept.get(key.episode_id, recorder.kept.get((key.episode_id, 0), []))) < 3:
                    await asyncio.wait({play}, timeout=0.05)
                    assert not play.done(), play
                play.cancel()
                await asyncio.gather(play, return_exceptions=True)
            box1 = await provider.create(SandboxSpec(source_dir=str(source)), "a1")
            retry = EpisodeKey(episode_id=key.episode_id, group_id="g0", task_id="t", attempt=1)
            outcome = await again.play(retry, "count", box1, [])
            await box0.destroy()
            await box1.destroy()
        finally:
            await first.close()
        return outcome

    outcome = asyncio.run(main())
    assert outcome.stop_reason == "harness_exit", outcome.failure
    live = chat.encode("live") + list(chat.stop_token_ids[:1])
    assert [t.completion_ids for t in outcome.turns] == [live, live]
    assert [(t.call_attempt, t.call_index) for t in outcome.turns] == [(1, 0), (1, 1)]  # (attempt, call index) on gateway-calls


def test_the_call_judge_counts_a_call_twice_a_missing_call_and_another_attempts_call():
    """The chaos ledger's judge itself, on calls and trajectories written here as the topics would
    hold them: (attempt, call index) -> (retry_of, output ids, logprobs)."""
    from rollway.config.run import RunConfig
    from rollway.runners.chaos import Ledger

    ledger = Ledger(RunConfig.model_validate({"run": {"id": "r"}, "agent": {"harness": {"command": ["x"]}}}), "unused:0")
    out = {i: ((10 + i,), (-0.5,)) for i in range(3)}
    ledger.calls = {("r-a", 0): {0: (None, *out[0]), 1: (None, *out[1])},  # a dead attempt: never graded
                    ("r-a", 1): {0: (None, *out[0]), 1: (None, *out[1])},
                    ("r-b", 0): {0: (None, *out[0]), 1: (None, *out[1])},
                    ("r-c", 1): {0: (None, *out[0])},
                    ("r-d", 0): {0: (None, *out[0]), 1: (0, *out[1]), 2: (None, *out[2])}}  # 1 retried 0
    ledger.graded = [("r-a", 1, [((1, 0), *out[0]), ((1, 1), *out[1])]),   # right
                     ("r-b", 0, [((0, 0), *out[0]), ((0, 0), *out[0])]),   # call 0 twice, call 1 lost
                     ("r-c", 1, [((0, 0), *out[0])]),                      # attempt 0's call in attempt 1's
                     ("r-d", 0, [((0, 1), *out[1]), ((0, 2), *out[2])])]   # the retry supersedes call 0
    got = ledger.judge_calls(ROOT, trains=False)
    assert got == {"calls_recorded": 10, "calls_in_trajectories": 7, "calls_lost": 2, "calls_duplicated": 1,
                   "calls_foreign": 1, "calls_out_of_order": 0, "dead_attempts": 1, "dead_attempt_calls": 2}


SHELL_CALL = '<tool_call>{{"name": "shell", "arguments": {{"command": "{}"}}}}</tool_call>'


@pytest.mark.broker
@pytest.mark.e2e
def test_killing_the_gateways_process_mid_episode_reruns_it_and_trains_each_call_once(tmp_path, broker, topic_prefix):
    """`rollway up`'s stages with one agent worker: examples/agent_program.py's first shell command
    waits for a file this test creates only after it has SIGKILLed the agent worker (the process that
    serves the episode's gateway) with that call acknowledged on gateway-calls and the program
    running. The program dies with its worker; the redelivered episode finds its turn claimed and the
    attempt fails; the scheduler re-runs it, and the one trajectory holds each call of its own
    attempt once. Everything is read back from the topics."""
    import yaml

    from rollway.actors.scheduler import new_run_id
    from rollway.config.run import load_config
    from rollway.runners.chaos import Ledger, descendants, jails_of
    from rollway.runners.up import run_job, write_run_files

    gate = tmp_path / "gate"
    gate.mkdir()
    wait = f"while [ ! -e {gate}/go ]; do sleep 0.05; done; cat numbers.txt"
    job = {
        "run": {"name": "killgw", "timeout_s": 300},
        "tasks": {"type": "toy", "count": 1},
        "scheduler": {"group_size": 1, "max_inflight_episodes": 1, "episode_deadline_s": 280, "max_attempts": 3},
        "agent": {"concurrency": 1, "harness": {
            "command": ["python3", "{install_path}/agent_program.py", "{instruction}"],
            "install": {"type": "host_dir", "path": str(ROOT / "examples")}, "time_limit_s": 200,
            "silence_limit_s": 200}},
        "sandbox": {"ro_binds": [str(gate)]},  # the program sees the file appear
        "policy": {"type": "scripted", "chat_format": "bytes-chatml", "script": [
            {"when": "Summary:", "turns": ["unused", "The sum is in answer.txt."]},
            {"when": "", "turns": [SHELL_CALL.format(wait),
                                   SHELL_CALL.format("awk '{print $1 + $2}' numbers.txt > answer.txt")]}]},
        "topics": {"prefix": topic_prefix},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    cfg = load_config(path)
    cfg.run.id = new_run_id()
    cfg.runtime.processes = "per-stage"  # the kill below takes the agent worker's process
    run_dir = tmp_path / "run"
    write_run_files(run_dir, cfg)
    ledger = Ledger(cfg, broker.bootstrap, poll_every_s=0.5)
    killed: dict = {}

    def kill_once_the_first_call_is_acknowledged(job) -> None:
        if killed:
            return
        ledger.maybe_poll()
        if ledger.calls.get((f"{cfg.run.id}-g00000-s0", 0)) is None:
            return
        (agent,) = [p for p in job.procs if p.stage == "agent" and p.alive]
        killed.update(programs=jails_of(agent.proc.pid), tree=descendants(agent.proc.pid))
        agent.proc.kill()
        (gate / "go").touch()

    summary = run_job(cfg, str(path), [], broker.bootstrap, run_dir, {"agent": 1, "init": 1, "reward": 1},
                      on_tick=kill_once_the_first_call_is_acknowledged, quiet=True)
    ledger.poll()
    assert killed["programs"] == 1, killed  # the program was running when its gateway died
    assert not [p for p in killed["tree"] if _running(p)], "a process of the killed worker's program outlived it"
    episode = f"{cfg.run.id}-g00000-s0"
    assert summary["episodes_completed"] == 1 and summary["episodes_failed"] == 0
    assert len(ledger.calls[(episode, 0)]) == 1  # acknowledged by the dead attempt, kept in the log
    assert len(ledger.calls[(episode, 1)]) == 3 and ledger.attempts[episode] == 2
    ((graded_episode, attempt, spans),) = ledger.graded
    assert (graded_episode, attempt) == (episode, 1)
    assert [ref for ref, _, _ in spans] == [(1, 0), (1, 1), (1, 2)]
    assert ledger.judge_calls(run_dir, trains=False) == {
        "calls_recorded": 4, "calls_in_trajectories": 3, "calls_lost": 0, "calls_duplicated": 0, "calls_foreign": 0,
        "calls_out_of_order": 0, "dead_attempts": 1, "dead_attempt_calls": 1}
    failures = [json.loads(line) for line in (run_dir / "failures.jsonl").read_text().splitlines()]
    assert [(f["stage"], f["episode"]["attempt"]) for f in failures] == [("agent", 0)]
    assert "already ran its tool calls once" in failures[0]["reason"]


def _running(process: tuple[int, int, int]) -> bool:
    from rollway.runners.chaos import _running as running

    return running(process[0], process[1])


@pytest.mark.e2e
@pytest.mark.slow
def test_chaos_run_of_harness_episodes_loses_and_duplicates_no_episode_and_no_call(tmp_path):
    """`rollway chaos examples/chaos-harness.yaml` on 3 tasks x 2 samples: agent workers are killed only
    while they run agent programs (with calls of a running attempt on the log), reward and learner
    workers at random, and the default fault points are armed. Judged from the topics: no episode lost
    or trained twice, and every trajectory holds each call of its own attempt once."""
    out = run_with_progress(
        [sys.executable, "-m", "rollway.runners", "chaos", "examples/chaos-harness.yaml", "--seed", "2", "--json",
         "--run-dir", str(tmp_path / "run"), "--kinds", "agent,reward,learner", "--min-gap", "1.0",
         "--max-gap", "2.0", "--max-kills", "6", "tasks.count=3"],
        cwd=ROOT)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0, (result, out.stderr[-2000:])
    assert result["scheduled"] == 6 and result["completed"] + result["failed"] == 6
    assert result["lost"] == 0 and result["duplicated"] == 0 and result["trained"] == result["completed"]
    assert {"agent", "reward", "learner"} <= set(result["killed_kinds"]), result["events"]
    assert result["agent_kills_with_programs"] >= 1 and result["programs_lingering"] == 0, result["events"]
    assert result["calls_lost"] == result["calls_duplicated"] == result["calls_foreign"] == 0
    # agent_program.py makes 3 calls unless a starved host hits the silence limit first (a timing matter,
    # not asserted); every recorded call is in a trajectory of its own attempt or of a dead attempt.
    assert 0 < result["calls_in_trajectories"] and result["dead_attempt_calls"] <= result["calls_recorded"]


@pytest.mark.e2e
@pytest.mark.slow
def test_chaos_run_of_harness_episodes_in_docker_containers_loses_nothing_and_leaves_no_container(tmp_path):
    """`rollway chaos examples/chaos-harness-docker.yaml` on 3 tasks x 2 samples, each episode's sandbox a
    real Docker container: agent workers are killed only while they serve a running agent program (its
    container's gateway socket listening, calls of a running attempt on the log), reward and learner
    workers at random. A killed worker's program is no child of it: it runs on in its container until
    the redelivered episode removes the container. Judged as the jail run (episodes and calls from the
    topics), plus: every container hit by a kill is removed during the run, none runs after it, and no
    container or volume of the run is left (counted here from the engine by the run's label prefix). The scripted policy is the
    model (the only fake); broker, engine, gateway and containers are real."""
    from agent_programs import mini_swe_agent
    from docker_engine import count_containers, ensure_engine, remove_labelled

    ensure_engine()
    site = next(mini_swe_agent().glob("lib/python3.*/site-packages"))  # the `openai` package, for the image's python3
    run_id = f"dchaos{uuid.uuid4().hex[:8]}"
    try:
        out = run_with_progress(
            [sys.executable, "-m", "rollway.runners", "chaos", "examples/chaos-harness-docker.yaml", "--seed", "2",
             "--json", "--run-dir", str(tmp_path / "run"), "--kinds", "agent,reward,learner", "--min-gap", "1.0",
             "--max-gap", "2.0", "--max-kills", "4", "tasks.count=3", f"run.id={run_id}",
             f"sandbox.ro_binds=[{site}]", f"agent.harness.env.PYTHONPATH={site}",
             f"sandbox.gateway_root={tmp_path / 'gateway'}"],
            cwd=ROOT)
        assert out.stdout.strip(), out.stderr[-3000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        left = count_containers(f"{run_id}-")
    finally:
        remove_labelled(f"{run_id}-")
    assert out.returncode == 0, (result, out.stderr[-2000:])
    assert result["scheduled"] == 6 and result["completed"] + result["failed"] == 6
    assert result["lost"] == 0 and result["duplicated"] == 0 and result["trained"] == result["completed"]
    assert {"agent", "reward", "learner"} <= set(result["killed_kinds"]), result["events"]
    assert result["agent_kills_with_programs"] >= 1, result["events"]
    assert result["programs_lingering"] == 0 and result["sandboxes_left"] == 0 and left == 0, result
    # Each container a kill orphaned was removed while the run went on (by the redelivered episode that
    # found its turn claimed, before the attempt failed and was re-run), not left to the end's reaper.
    orphaned = result["orphan_container_s"]
    assert orphaned and None not in orphaned.values(), orphaned
    assert result["calls_lost"] == result["calls_duplicated"] == result["calls_foreign"] == 0
    assert 0 < result["calls_in_trajectories"] and result["dead_attempt_calls"] <= result["calls_recorded"]


def test_the_monkey_sees_a_workers_gateway_sockets_and_which_it_left_dead(tmp_path):
    """How a chaos run sees the programs an agent worker serves in docker containers (they are no children
    of it): its listening `gateway.sock` sockets, bound the gateway's way (through /proc/self/fd, so a
    folder path of any length); after its death, the socket files that refuse connections name the
    containers whose programs it served."""
    import os

    from rollway.gateway.server import _bound_unix_socket
    from rollway.runners.chaos import dead_sockets, served_sockets

    root = tmp_path / ("g" * 80)  # socket paths past the 107 bytes a socket address holds
    for name in ("run-g0-s0-a0-x", "run-g0-s1-a0-y"):
        (root / name).mkdir(parents=True)
    live = _bound_unix_socket(str(root / "run-g0-s0-a0-x" / "gateway.sock"))
    gone = _bound_unix_socket(str(root / "run-g0-s1-a0-y" / "gateway.sock"))
    before = served_sockets(os.getpid())
    live.listen()
    gone.listen()
    assert served_sockets(os.getpid()) == before + 2
    gone.close()  # its process died: the file stays, nothing listens
    try:
        assert dead_sockets(str(root)) == {"run-g0-s1-a0-y"}
        assert served_sockets(os.getpid()) == before + 1
    finally:
        live.close()
    assert dead_sockets(None) == set()
