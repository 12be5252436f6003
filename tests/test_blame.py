"""The failure rule (base/blame.py, docs/security/grading.md): once the agent's code ran, a failure is the
agent's (graded 0, trained on); only what it could not cause is infrastructure (retried). The episode
tests run the real init, agent and reward actors on a toy task in the real bubblewrap jail; the model is
the scripted policy, and where a failure must be provoked a task-set hook or the inference client is
replaced by one that raises (said in each test)."""

from __future__ import annotations

import asyncio
import json

import pytest

from rollway.actors.agent import TurnReplayed
from rollway.base.blame import InferenceUnreachable, blame, found_before_agent_code, graded_failures
from rollway.envs.swe_grading import GradingEnvError
from rollway.envs.swe_images import EnvPrepError
from rollway.gateway.recorder import RecordFailed, RecordTooLarge
from rollway.policies.base import inference_refusal
from rollway.runtime.kafka import BrokerUnavailable
from rollway.sandboxes.base import EngineUnreachable, OutputLost, SandboxError, SandboxGone


def _caused(error: BaseException, cause: BaseException) -> BaseException:
    error.__cause__ = cause
    return error


@pytest.mark.parametrize(("error", "verdict"), [
    (RuntimeError("anything rollway does not know"), "agent"),
    (SandboxError("container rollway-x is not running"), "agent"),
    (OutputLost("the Docker engine lost the output of a command (no end marker)"), "agent"),
    (EngineUnreachable("Docker engine stopped answering"), "infrastructure"),
    (SandboxGone("gone"), "infrastructure"),
    (BrokerUnavailable("down"), "infrastructure"),
    (RecordFailed("not recorded"), "infrastructure"),
    (RecordTooLarge("the program's call encodes past the broker's limit"), "agent"),  # its size is the program's
    (TurnReplayed("replayed"), "infrastructure"),
    (InferenceUnreachable("no connection"), "infrastructure"),
    (inference_refusal("prompt longer than the context", 400), "agent"),  # the agent's observations made it
    (inference_refusal("token id out of vocabulary", 422), "agent"),
    (inference_refusal("the model `policy-v3` does not exist", 404), "infrastructure"),  # the operator's settings
    (inference_refusal("Unauthorized", 401), "infrastructure"),
    (GradingEnvError("env_error: runner broken on the unpatched tree"), "infrastructure"),
    (EnvPrepError("image cannot be built"), "infrastructure"),
    (found_before_agent_code(SandboxError("verifier did not start")), "infrastructure"),
    (_caused(SandboxError("grading failed"), EngineUnreachable("engine gone")), "infrastructure"),
    (_caused(RuntimeError("wrapped"), SandboxError("not running")), "agent"),
])
def test_blame_after_the_agent_ran(error, verdict):
    assert blame(error, agent_ran=True) == verdict
    assert blame(error, agent_ran=False) == "infrastructure"  # nothing of the agent's has run yet


def test_graded_failures_count_by_stage_and_kind():
    trajs = [{"grade": {"outcome": "agent_failure", "failure_stage": "agent", "failure_kind": "HarnessCrashed"}},
             {"grade": {"outcome": "agent_failure", "failure_stage": "reward", "failure_kind": "SandboxError"}},
             {"grade": {"outcome": "agent_failure", "failure_stage": "agent", "failure_kind": "HarnessCrashed"}},
             {"grade": {"outcome": "unresolved"}}, {"grade": {}}]
    assert graded_failures(trajs) == {"agent: HarnessCrashed": 2, "reward: SandboxError": 1}


CALL = '<tool_call>{"name": "bash", "arguments": {"command": "echo ran > ran.txt"}}</tool_call>'
FINISH = '<tool_call>{"name": "finish", "arguments": {}}</tool_call>'


def _services(tmp_path):
    from rollway.actors.services import Services
    from rollway.config.run import load_config

    script = [{"when": "", "turns": [CALL, CALL, FINISH]}]
    cfg = load_config(None, ["tasks.type=toy", "tasks.count=1", "sandbox.type=local", "agent.max_turns=4",
                             'tools.enabled=["bash", "finish"]', "policy=" + json.dumps({"type": "scripted",
                                                                                         "script": script})])
    return cfg, Services(cfg, tmp_path)


def test_a_turn_that_fails_after_its_tool_calls_ran_is_graded_0_with_its_completion(tmp_path):
    """An environment that fails on what the agent's tools left (one that raises at the second turn): the
    episode ends there, graded 0 with the reason, the failing turn's completion in the token-exact trajectory
    (trained on with reward 0)."""
    from rollway.audit.verify import play_episode
    from rollway.envs.base import Environment

    cfg, s = _services(tmp_path)
    seen = []

    class ChokesOnTheSecondTurn(Environment):
        async def step(self, output, episode):
            step = await super().step(output, episode)
            seen.append(step.observations)
            if len(seen) == 2:
                raise ValueError("the environment choked on the agent's output")
            return step

    s.taskset.environment_class = ChokesOnTheSecondTurn
    traj = asyncio.run(play_episode(cfg, tmp_path, "toy-000", services=s))
    assert (traj.reward, traj.resolved, traj.stop_reason) == (0.0, False, "agent_failure")
    assert traj.grade["failure_kind"] == "ValueError" and "choked" in traj.grade["failure"]
    assert traj.grade["failure_stage"] == "agent"
    assert traj.num_turns == 2 and [t.assistant_text for t in traj.turns] == [CALL, CALL]
    assert len(traj.token_ids) == len(traj.loss_mask) == len(traj.logprobs)
    assert sum(traj.loss_mask) == sum(e - s for s, e in traj.turn_spans)
    assert traj.turns[-1].observation_ids == []  # nothing was generated after the failing turn


def test_an_unreachable_inference_engine_fails_the_attempt_for_a_retry(tmp_path):
    """The engine stops answering at turn 1 (the client replaced by one that raises ConnectionError, as the
    OpenAI-compatible client does after its retries): infrastructure, even though the agent ran a tool
    call at turn 0. The attempt fails retryably and nothing is graded."""
    from rollway.actors.agent import AgentActor
    from rollway.audit.verify import play_episode
    from rollway.runtime.actor import failure_output
    from rollway.schemas.messages import EpisodeKey, InitRequest

    cfg, s = _services(tmp_path)
    real = s.inference.generate

    async def generate(prompt_ids, params):
        if params.turn >= 1:
            raise ConnectionError("POST /v1/completions failed after 3 attempts")
        return await real(prompt_ids, params)

    s.inference.generate = generate
    with pytest.raises(InferenceUnreachable) as caught:
        asyncio.run(play_episode(cfg, tmp_path, "toy-000", services=s))
    msg = InitRequest(episode=EpisodeKey(episode_id="e", group_id="e", task_id="toy-000"), issued_at=0, deadline=0)
    assert failure_output(msg, AgentActor.name, caught.value).value.retryable


class _DyingEngine:
    """An HTTP server standing in for an inference engine that is killed while it answers (fake: a raw
    socket server, no model): each of its first `deaths` completions gets the status line, headers and
    half of the body, then the connection closes. Later ones get the whole answer."""

    BODY = json.dumps({"choices": [{"token_ids": [1, 2], "logprobs": {"token_logprobs": [-0.1, -0.2]},
                                    "finish_reason": "stop"}]}).encode()

    def __init__(self, deaths: int):
        self.deaths, self.requests = deaths, 0
        self.lines: list[bytes] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        self.requests += 1
        self.lines.append(head.split(b"\r\n")[0])
        body = self.BODY if self.requests > self.deaths else self.BODY[:len(self.BODY) // 2]
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(self.BODY), body))
        await writer.drain()
        writer.close()


@pytest.mark.parametrize("deaths", [1, 99])
def test_an_engine_killed_while_it_answers_is_infrastructure(deaths):
    """An engine restart cuts a completion's body short (aiohttp: ClientPayloadError, not a connection
    error). The client retries it like a refused connection: an engine back within the retries answers the
    turn; one still gone raises ConnectionError, the OSError that the agent stage (actors/turn.py) and the
    gateway turn into `InferenceUnreachable` (retried), never a 0 for the episode."""
    from rollway.policies.base import SamplingParams
    from rollway.policies.openai_client import OpenAICompletionsClient

    async def play():
        engine = _DyingEngine(deaths)
        server = await asyncio.start_server(engine.serve, "127.0.0.1", 0)
        client = OpenAICompletionsClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1", model="m",
                                         max_retries=2, backoff_s=0.01)
        try:
            return await client.generate([1, 2, 3], SamplingParams(max_tokens=2))
        finally:
            await client.close()
            server.close()

    if deaths == 1:
        assert asyncio.run(play()).token_ids == [1, 2]
    else:
        with pytest.raises(ConnectionError, match="failed after 3 attempts"):
            asyncio.run(play())


class _GarbledEngine(_DyingEngine):
    """An HTTP server standing in for an inference engine (fake: a raw socket server, no model) that answers
    every request 200 with `body`, whole."""

    def __init__(self, body: bytes):
        super().__init__(0)
        self.BODY = body


_ONE_CHOICE = {"token_ids": [1, 2], "logprobs": {"token_logprobs": [-0.1, -0.2]}, "finish_reason": "stop"}


@pytest.mark.parametrize("body", [
    b"<html>502 Bad Gateway</html>",  # a proxy's page with a 200
    json.dumps({"choices": []}).encode(),
    json.dumps({"object": "error"}).encode(),
    json.dumps({"choices": [{**_ONE_CHOICE, "logprobs": {"token_logprobs": [-0.1]}}]}).encode(),  # not token ids
    json.dumps({"choices": [{**_ONE_CHOICE, "token_ids": ["a", "b"]}]}).encode(),
    json.dumps({"choices": [{**_ONE_CHOICE, "token_ids": [1, 2**31]}]}).encode(),  # past any vocabulary
    json.dumps({"choices": [{**_ONE_CHOICE, "token_ids": [1, 2**70]}]}).encode(),  # past what MessagePack holds
    json.dumps([1, 2]).encode(),
], ids=["not-json", "no-choices", "no-choices-key", "logprobs-short", "ids-not-ints", "ids-past-2-31", "ids-past-2-64",
        "a-list"])
def test_an_engine_answer_the_client_cannot_read_is_infrastructure(body):
    """What the engine answers is the engine's (or its settings') doing: no program and no model shapes its
    JSON. An answer the client cannot read must be the OSError the agent stage and the gateway take for the
    engine's failure (retried), not a ValueError or KeyError graded as the agent's 0; and it is not sent
    again (the engine would answer the same). The gateway says so to the program as a 502."""
    import openai

    from rollway.gateway import Gateway, MemoryRecorder
    from rollway.policies.base import SamplingParams
    from rollway.policies.chat import BytesChatML
    from rollway.policies.openai_client import OpenAICompletionsClient
    from rollway.schemas.messages import EpisodeKey

    async def play():
        engine = _GarbledEngine(body)
        server = await asyncio.start_server(engine.serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
        client = OpenAICompletionsClient(url, model="m", max_retries=2, backoff_s=0.01)
        gateway = Gateway(OpenAICompletionsClient(url, model="m", max_retries=0), BytesChatML(), MemoryRecorder())
        await gateway.start()
        try:
            with pytest.raises(ConnectionError, match="could not read"):
                await client.generate([1, 2, 3], SamplingParams(max_tokens=2))
            handle = gateway.open_episode(EpisodeKey(episode_id="e", group_id="g", task_id="t"))
            program = openai.AsyncOpenAI(base_url=handle.base_url, api_key="unused", max_retries=0)
            with pytest.raises(openai.APIStatusError) as caught:
                await program.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            assert caught.value.status_code >= 500, caught.value
            assert "could not read" in (handle.infrastructure_failure or ""), handle.infrastructure_failure
        finally:
            await gateway.stop()
            await client.close()
            server.close()
        return engine.lines

    assert [line for line in asyncio.run(play()) if line.startswith(b"POST")] == [b"POST /v1/completions HTTP/1.1"] * 2
    # one each from the client and the gateway: neither sent again


def _up(tmp_path, script: list[dict], max_turns: int, scheduler: dict | None = None, agent: dict | None = None,
        tools: list[str] | None = None, tasks: dict | None = None, **broker) -> tuple[dict, list[dict], list[dict]]:
    """`rollway up` of one episode (a toy task unless `tasks`) in the local jail (real broker, the scripted
    policy as the model): summary, trajectories and failures."""
    import subprocess
    import sys

    import yaml
    from conftest import ROOT

    job = {"run": {"name": "refused", "timeout_s": 300}, "tasks": tasks or {"type": "toy", "count": 1},
           "sandbox": {"type": "local"}, "broker": broker, "tools": {"enabled": tools or ["bash", "finish"]},
           "scheduler": {"group_size": 1, "max_attempts": 2, "episode_deadline_s": 200, **(scheduler or {})},
           "agent": {"max_turns": max_turns, "max_tokens_per_turn": 400_000, "max_total_tokens": 1_000_000,
                     **(agent or {})},
           "policy": {"type": "scripted", "chat_format": "bytes-chatml", "script": script}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "rollway.runners", "up", "--no-report", str(tmp_path / "job.yaml"),
                          "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = {name: [json.loads(x) for x in (run_dir / name).read_text().splitlines()] if (run_dir / name).exists()
             else [] for name in ("trajectories.jsonl", "failures.jsonl")}
    return json.loads((run_dir / "summary.json").read_text()), lines["trajectories.jsonl"], lines["failures.jsonl"]


@pytest.mark.e2e
@pytest.mark.parametrize(("turns", "stage"), [(3, "agent"), (2, "reward")])
def test_an_episode_too_large_for_the_broker_is_graded_0_with_the_turns_that_fit(tmp_path, turns, stage):
    """The model writes turns until its episode is over `broker.max_message_bytes` (a 1 MB limit here, turns
    of 30,000 tokens: each turn's message fits; with three the agent stage's reward request does not, with two
    the reward stage's trajectory does not). That used to be a final failure, never graded nor trained on: a
    way out of a 0 the model chooses. It is the model's 0, with the turns that fit."""
    long_call = '<tool_call>{"name": "bash", "arguments": {"command": "true #' + "x" * 30_000 + '"}}</tool_call>'
    summary, trajs, failures = _up(tmp_path, [{"when": "", "turns": [long_call]}], turns, max_message_bytes=1_000_000)
    assert failures == [] and len(trajs) == 1, (summary, failures)
    [t] = trajs
    assert (t["reward"], t["stop_reason"], t["grade"]["failure_kind"]) == (0.0, "agent_failure", "OutputRefused")
    assert t["grade"]["failure_stage"] == stage and "max_message_bytes=1000000" in t["grade"]["failure"]
    assert t["num_turns"] == 1 and t["turns"][0]["assistant_text"] == long_call[:2000]
    assert len(t["token_ids"]) == len(t["loss_mask"]) == len(t["logprobs"]) > 30_000
    assert summary["graded_failures"] == {f"{stage}: OutputRefused": 1}


@pytest.mark.e2e
def test_an_agent_that_would_outlast_its_deadline_is_graded_as_it_stands_not_reissued(tmp_path):
    """Each turn's tool call sleeps 8 s, six turns, against a 20 s episode deadline. The scheduler re-issues an
    attempt past its deadline as lost work, and records the episode failed after the last attempt: nothing
    graded, no 0 for an agent that is merely slow (before: `deadline: not finished within 20s after 2
    attempts`, no trajectory). The agent's phase now ends the deadline less a fifth of it
    (`scheduler.grading_reserve_s`) after its sandbox is ready: `agent_timeout`, graded as it stands."""
    sleep = '<tool_call>{"name": "bash", "arguments": {"command": "sleep 8"}}</tool_call>'
    summary, trajs, failures = _up(tmp_path, [{"when": "", "turns": [sleep]}], 6, scheduler={"episode_deadline_s": 20})
    assert failures == [] and len(trajs) == 1, (summary, failures)
    [t] = trajs
    assert (t["stop_reason"], t["reward"]) == ("agent_timeout", 0.0) and "outcome" not in t["grade"], t["grade"]
    assert 1 <= t["num_turns"] <= 2  # 16 s of agent time: the second sleep is cut to what is left


@pytest.mark.e2e
@pytest.mark.parametrize("driver", ["turns", "harness"])
def test_a_generation_that_would_outlast_the_deadline_ends_at_the_agents_time_and_is_graded(tmp_path, driver):
    """The model takes 60 s to answer (the scripted model's `seconds`: a policy that rambles to its token
    limit on a busy engine) against a 20 s episode deadline, in built-in turns and for a call of a harness
    program (its time limit 15 s). Before, nothing bounded a generation by the agent's time: the built-in turn waited for it, and a
    harness program killed at its time had its episode's end wait for the call in flight; either ran past
    the deadline, was re-issued and finally recorded failed, never graded. Now the generation is cancelled
    when the agent's time (16 s) is up, and the episode is graded as it stands."""
    from conftest import ROOT

    harness = {"harness": {"command": ["python3", f"{ROOT}/examples/agent_program.py", "{instruction}"],
                           "install": {"type": "host_dir", "path": str(ROOT / "examples")},
                           "time_limit_s": 15, "silence_limit_s": 15}}
    summary, trajs, failures = _up(tmp_path, [{"when": "", "turns": ["Let me think."], "seconds": 60}], 6,
                                   scheduler={"episode_deadline_s": 20}, agent=harness if driver == "harness" else None)
    assert failures == [] and len(trajs) == 1, (summary, failures)
    [t] = trajs
    stop = "agent_timeout" if driver == "turns" else "harness_time_limit"
    assert (t["stop_reason"], t["reward"]) == (stop, 0.0) and "outcome" not in t["grade"], t["grade"]


@pytest.mark.e2e
def test_tool_calls_that_would_outlast_the_deadline_end_at_the_agents_time_and_are_graded(tmp_path):
    """Three calls in one message to a tool that runs no command (tests/plugins/slow_tool.py, standing in for
    a search over a workspace the agent filled), 25 s each, against a 20 s episode deadline. Each is within
    its own limit (`tools.call_timeout_s`), and only commands were cut to the agent's time: the turn's tools
    ran past the deadline, the attempt was re-issued and the episode finally recorded failed, never graded.
    Now a turn's tool calls end when the agent's time (16 s) is up, and the episode is graded as it stands."""
    ponder = "".join('<tool_call>{"name": "ponder", "arguments": {"seconds": 25}}</tool_call>' for _ in range(3))
    summary, trajs, failures = _up(tmp_path, [{"when": "", "turns": [ponder]}], 6, scheduler={"episode_deadline_s": 20},
                                   tools=["python:tests/plugins/slow_tool.py:Ponder", "finish"])
    assert failures == [] and len(trajs) == 1, (summary, failures)
    [t] = trajs
    assert (t["stop_reason"], t["reward"]) == ("agent_timeout", 0.0) and "outcome" not in t["grade"], t["grade"]
    assert t["num_turns"] == 1 and t["turns"][0]["assistant_text"] == ponder  # the model's message is kept


@pytest.mark.e2e
def test_a_grading_the_agent_made_slow_is_waited_for_and_its_0_counted(tmp_path):
    """The agent writes a HumanEval solution that sleeps on import: the real grader runs it until its test time
    limit (`tasks.test_timeout_s`, 30 s), longer than the whole episode's deadline (24 s). The scheduler re-issued
    an attempt past its deadline however far it had got, so this attempt was given up (with one attempt
    allowed: recorded failed, `deadline: not finished within 24s after 1 attempts`) and the grader's late 0
    ignored: a 0 the agent escapes by making its grading slow. Once an attempt reaches the reward stage its
    deadline is now its grading's (the task set's grading limits and the reserve), and the 0 is counted."""
    write = ('<tool_call>{"name": "bash", "arguments": {"command": '
             '"printf \'import time\\ntime.sleep(600)\\n\' > solution.py"}}</tool_call>')
    summary, trajs, failures = _up(tmp_path, [{"when": "", "turns": [write, FINISH]}], 4,
                                   scheduler={"episode_deadline_s": 24, "grading_reserve_s": 12, "max_attempts": 1},
                                   tasks={"type": "humaneval", "limit": 1, "test_timeout_s": 30})
    assert failures == [] and len(trajs) == 1, (summary, failures)
    [t] = trajs
    assert (t["stop_reason"], t["reward"], t["episode"]["attempt"]) == ("test_timeout", 0.0, 0), t["grade"]


def test_an_in_process_episode_that_fails_leaves_no_sandbox(tmp_path, monkeypatch):
    """`tasks verify`, the grader check and the benchmarks play episodes in one process, with no run reaper
    after them: an attempt that ends failed must not leave its sandbox (a folder and a mounted workspace per
    attempt; one was left by every whole test run). Made to fail here as an episode does whose message the
    broker cannot take and that cannot be cut to fit (its prompt alone too large): `refused_as_graded_0`
    gives None, and the agent stage's failure output carries no trajectory."""
    from rollway.actors import agent, reward
    from rollway.actors.services import Services
    from rollway.audit.verify import play_episode
    from rollway.config.run import load_config

    boxes = tmp_path / "boxes"
    call = '<tool_call>{"name": "bash", "arguments": {"command": "true #' + "x" * 1500 + '"}}</tool_call>'
    cfg = load_config(None, ["tasks.type=toy", "tasks.count=1", "sandbox.type=local", f"sandbox.root={boxes}",
                             "broker.max_message_bytes=65536", "agent.max_turns=6", "agent.max_tokens_per_turn=100000",
                             "agent.max_total_tokens=4000000", 'tools.enabled=["bash", "finish"]',
                             "policy=" + json.dumps({"type": "scripted", "script": [{"when": "", "turns": [call]}]})])
    for module in (agent, reward):
        monkeypatch.setattr(module, "refused_as_graded_0", lambda *a: None)
    with pytest.raises(RuntimeError, match="the episode failed"):
        asyncio.run(play_episode(cfg, tmp_path / "run", "toy-000", services=Services(cfg, tmp_path / "run")))
    assert boxes.is_dir() and not any(boxes.iterdir()), sorted(p.name for p in boxes.iterdir())
