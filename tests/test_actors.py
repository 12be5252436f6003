"""Each actor's logic, called directly (no broker): scripted policy, real bubblewrap sandboxes."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import msgspec
import pytest
from conftest import ROOT, run

from rollway.actors.agent import AgentActor
from rollway.actors.init import InitActor
from rollway.actors.learner import LearnerActor
from rollway.actors.reward import RewardActor
from rollway.actors.scheduler import SchedulerActor
from rollway.actors.services import Services
from rollway.actors.sink import SinkActor
from rollway.config.run import load_config
from rollway.runtime.actor import MessageMeta
from rollway.runtime.inprocess import InProcessDriver
from rollway.schemas import (
    AgentStep,
    EpisodeFailure,
    EpisodeKey,
    InitRequest,
    PolicyVersion,
    RewardRequest,
    Trajectory,
)
from rollway.topics import INIT_REQUESTS


def services(tmp_path: Path, *overrides: str) -> Services:
    cfg = load_config(ROOT / "examples" / "smoke.yaml", list(overrides))
    return Services(cfg, tmp_path / "run")


def meta(offset: int = 0) -> MessageMeta:
    return MessageMeta("agent-steps", 0, offset)


async def play_seen(s: Services, key: EpisodeKey) -> tuple[Trajectory, list]:
    """One episode through the in-process driver (the rollout stages, chained as the topology says): its
    trajectory and every message handed to a stage, in order (the init request first)."""
    seen: list = []

    @contextlib.asynccontextmanager
    async def keep(stage, msg, meta):
        seen.append(msg)
        yield

    async with InProcessDriver(s) as driver:
        return await driver.play(key, keep), seen


async def play_episode(s: Services, task_id: str = "toy-001", episode_id: str = "r1-g0-s0") -> Trajectory:
    """init -> agent turns -> reward; the reward stage tears the sandbox down."""
    traj, seen = await play_seen(s, EpisodeKey(episode_id=episode_id, group_id="r1-g0", task_id=task_id))
    assert isinstance(seen[1], AgentStep) and seen[1].episode_id == episode_id and isinstance(seen[-1], RewardRequest)
    assert not Path(seen[1].sandbox["path"]).exists(), "the reward actor must tear the sandbox down"
    return traj


@pytest.mark.parametrize(("context", "reward"), [(1720, 1.0), (1530, 0.0)])
def test_an_episode_at_the_engines_context_ends_graded_as_it_stands(tmp_path, context, reward):
    """The scripted model declares a context as an engine does (policy.max_model_len) and refuses a longer
    prompt as an engine does. toy-001's fourth prompt is 1,730 tokens, its third 1,559: the episode ends
    before the prompt the engine would refuse (`prompt_too_long`) and is graded as it stands: resolved when
    the answer was written (1720), not when it was not yet (1530), never the agent's failure. Before, the
    refused call failed the turn: graded 0 as `agent_failure` even with the answer written."""
    traj = run(play_episode(services(tmp_path, f"policy.max_model_len={context}")))
    assert traj.stop_reason == "prompt_too_long" and traj.reward == reward, traj.grade
    assert "outcome" not in traj.grade  # no failure
    # It ended before the call the engine would refuse (the trajectory holds that prompt, never sent).
    assert traj.turns[-1].completion_ids == [] and len(traj.token_ids) >= context

def test_scripted_episode_solves_toy_task_token_exact(tmp_path):
    s = services(tmp_path)
    traj = run(play_episode(s))
    assert traj.reward == 1.0 and traj.resolved and traj.stop_reason == "finish"
    assert traj.num_turns == 4
    n = len(traj.token_ids)
    assert n > 0 and len(traj.loss_mask) == n == len(traj.logprobs)
    # The model's tokens are exactly the scripted outputs, in order, under mask 1.
    chat = s.chat
    for (start, end), turn_text in zip(traj.turn_spans, s.cfg.policy.script[0].turns, strict=True):
        assert chat.decode(traj.token_ids[start:end]) == turn_text
        assert all(traj.loss_mask[start:end]) and all(lp is not None for lp in traj.logprobs[start:end])
    assert sum(traj.loss_mask) == sum(e - s_ for s_, e in traj.turn_spans)
    # The observation of `cat numbers.txt` is in the token stream the model saw next.
    t = s.taskset.get("toy-001").metadata
    assert f"{t['a']} {t['b']}" in chat.decode(traj.token_ids)
    # Each turn keeps its own generation and tool times (the agent's timeout needs them); stage times
    # are the runtime's telemetry, not the message's.
    for u in traj.turns:
        assert u.gen_seconds > 0 and u.gen_started_at <= u.gen_ended_at <= u.tool_ended_at
    assert not {"timings", "stamps", "sent_at"} & set(msgspec.structs.asdict(traj))


def test_agent_that_does_nothing_is_not_rewarded_and_stops_at_max_turns(tmp_path):
    s = services(tmp_path, "policy.script=[{when: '', turns: ['I am thinking.']}]", "agent.max_turns=3")
    traj = run(play_episode(s))
    assert traj.reward == 0.0 and not traj.resolved
    assert traj.stop_reason == "max_turns" and traj.num_turns == 3
    # No tool call: the model was told how to call tools.
    assert "tool_call" in traj.turns[0].observations[0].content


def test_agent_rebuilds_episode_from_log_when_another_worker_ran_earlier_turns(tmp_path):
    """A fresh agent worker (empty cache) continues an episode from the log."""
    s = services(tmp_path)

    async def scenario():
        init, agent = InitActor(s), AgentActor(s)
        await init.setup()
        [out] = await init.handle(InitRequest(episode=EpisodeKey(episode_id="r1-g0-s1", group_id="r1-g0", task_id="toy-002"),
                                              issued_at=time.time(), deadline=time.time() + 60), meta())
        log = [(10, out.value)]
        [out] = await agent.handle(out.value, meta(10))
        log.append((11, out.value))
        [out] = await agent.handle(out.value, meta(11))
        log.append((12, out.value))

        async def read_log(topic, partition, start, episode_id):
            return [(o, m) for o, m in log if o >= start and m.episode_id == episode_id]

        fresh = AgentActor(s, read_log)
        [nxt] = await fresh.handle(out.value, meta(12))
        assert nxt.value.turn == 3 and nxt.value.start_offset == 10
        # A redelivered old turn is recognised as already done (the log has a later turn).
        log.append((13, nxt.value))
        assert await AgentActor(s, read_log).handle(log[1][1], meta(11)) == []
        # The original worker running turn 2 again (it crashed or lost the partition before its
        # produce landed) would repeat tool calls on a changed sandbox: the turn marker refuses it,
        # the attempt fails retryably and its sandbox is gone (the scheduler re-issues it fresh).
        [again] = await agent.handle(out.value, meta(12))
        assert again.value.stage == "agent" and again.value.retryable and "already ran" in again.value.reason
        assert not Path(out.value.sandbox["path"]).exists()

    run(scenario())


def test_scheduler_groups_inflight_bound_deadlines_and_failures(tmp_path):
    s = services(tmp_path, "tasks.count=3", "scheduler.group_size=2", "scheduler.max_inflight_episodes=4",
                 "scheduler.episode_deadline_s=0.2", "scheduler.max_attempts=2", "run.id=rX")

    async def scenario():
        sched = SchedulerActor(s)
        await sched.setup()
        first = await sched.tick()
        assert len(first) == 4 and all(o.topic is INIT_REQUESTS for o in first)  # 2 groups of 2
        groups = {o.value.group_id for o in first}
        assert len(groups) == 2
        assert await sched.tick() == []  # full: the third group waits
        a, b = first[0].value, first[1].value
        traj = Trajectory(episode=a.episode, token_ids=[1],
                          loss_mask=[1], logprobs=[-1.0], turn_policy_versions=[0], turn_spans=[(0, 1)],
                          reward=1.0, resolved=True, stop_reason="finish", num_turns=1, prompt_length=0)
        await sched.handle(traj, meta())
        await sched.handle(traj, meta())  # a late duplicate changes nothing
        assert sched.counts()["episodes_completed"] == 1
        # A retryable failure re-issues the same episode id with the next attempt.
        fail = EpisodeFailure(episode=b.episode, stage="init",
                              reason="boom")
        [re] = await sched.handle(fail, meta())
        assert re.value.episode_id == b.episode_id and re.value.attempt == 1
        # Deadlines: everything in flight past its deadline is re-issued once, then failed.
        time.sleep(0.25)
        reissued = await sched.tick()
        assert {o.value.episode_id for o in reissued if o.value.attempt == 1} >= {o.value.episode_id for o in first[2:]}
        time.sleep(0.25)
        await sched.tick()
        counts = sched.counts()
        assert counts["episodes_failed"] >= 3 and counts["episodes_completed"] == 1
        await sched.handle(PolicyVersion(version=5), meta())
        assert sched.policy_version == 5

    run(scenario())


def test_scheduler_waits_for_a_grading_once_the_attempt_reached_the_reward_stage(tmp_path):
    """Past the episode's deadline an attempt is re-issued, unless its reward request is on the log: from then
    its deadline is its grading's (the task set's grading limits, here one command's 30 s, plus the reserve),
    so a grading the agent made slow is waited for and its 0 counted; one that reaches the reward stage behind
    it waits for it too (one grading at a time here). A request of an older attempt moves nothing, and a
    restarted scheduler reads the requests back (their turns skipped, not decoded)."""
    from rollway.schemas.codec import decode, encode

    s = services(tmp_path, "tasks.count=3", "scheduler.group_size=1", "scheduler.episode_deadline_s=0.3",
                 "scheduler.max_attempts=2", "reward.concurrency=1", "run.id=rG")

    def request(key: EpisodeKey) -> RewardRequest:
        return RewardRequest(episode=key, sandbox={}, prompt_ids=[1] * 1000, messages=[], turns=[], stop_reason="finish")

    async def scenario():
        sched = SchedulerActor(s)
        await sched.setup()
        graded, lost, queued = [o.value for o in await sched.tick()]
        await sched.handle(request(graded.episode), MessageMeta("reward-requests", 0, 0, int(time.time() * 1000)))
        await sched.handle(request(queued.episode), MessageMeta("reward-requests", 0, 1, int(time.time() * 1000)))
        assert sched.tickets[queued.episode_id].deadline >= time.time() + 59  # its 30 s after the other's
        stale = msgspec.structs.replace(lost.episode, attempt=lost.attempt + 5)
        await sched.handle(request(stale), meta())
        time.sleep(0.35)
        [again] = await sched.tick()
        assert (again.value.episode_id, again.value.attempt) == (lost.episode_id, 1)
        assert sched.tickets[graded.episode_id].deadline >= time.time() + 29

        async def scan(spec):
            for m in {"init-requests": [graded, lost], "reward-requests": [request(graded.episode)]}.get(spec.name, []):
                yield decode(encode(m), spec.value)

        restarted = SchedulerActor(s, scan)
        await restarted.setup()
        assert restarted.tickets[graded.episode_id].at_reward and not restarted.tickets[lost.episode_id].at_reward
        assert not restarted.tickets[queued.episode_id].at_reward  # its request is not in this log
        time.sleep(0.35)
        assert [o.value.episode_id for o in await restarted.tick()] == [lost.episode_id, queued.episode_id]

    run(scenario())


def test_scheduler_refuses_a_group_timeout_that_would_leave_a_slow_member_out(tmp_path):
    """A training learner's group timeout shorter than an episode may take (its deadline plus the task set's
    longest grading limit) trains a group without a member that is merely slow: a 0 a policy escapes by being
    slow. Refused when the run starts, naming the least value; one at least that long is taken."""
    base = ("tasks.count=2", "scheduler.episode_deadline_s=100", "learner.type=ppo")
    short = SchedulerActor(services(tmp_path, *base, "learner.group_timeout_s=60"))
    with pytest.raises(ValueError, match=r"group_timeout_s=60 .* at least 130"):
        run(short.setup())  # 100 s + one command's 30 s, the toy task set's grading limit
    run(SchedulerActor(services(tmp_path, *base, "learner.group_timeout_s=130")).setup())
    run(SchedulerActor(services(tmp_path, *base[:2], "learner.group_timeout_s=60")).setup())  # no training: no group


def test_scheduler_holds_back_groups_beyond_policy_lag(tmp_path):
    s = services(tmp_path, "tasks.count=4", "scheduler.group_size=1", "scheduler.max_inflight_episodes=10",
                 "scheduler.max_policy_lag=1")

    async def scenario():
        sched = SchedulerActor(s)
        await sched.setup()
        assert len(await sched.tick()) == 4
        # all issued at version 0; new work only matters when more remains, so plan more:
        s2 = services(tmp_path, "tasks.count=4", "scheduler.group_size=1", "scheduler.max_inflight_episodes=2",
                      "scheduler.max_policy_lag=1")
        lagged = SchedulerActor(s2)
        await lagged.setup()
        assert len(await lagged.tick()) == 2
        await lagged.handle(PolicyVersion(version=3), meta())
        first = next(t for t in lagged.tickets.values() if t.state == "inflight")
        first.state = "completed"
        assert await lagged.tick() == []  # room for one, but the oldest in-flight is 3 versions behind

    run(scenario())


def test_sink_and_learner_deduplicate_and_survive_restart(tmp_path):
    s = services(tmp_path, "run.id=rZ")

    def traj(eid: str) -> Trajectory:
        return Trajectory(episode=EpisodeKey(episode_id=eid, group_id="rZ-g0", task_id="toy-000"), token_ids=[1, 2], loss_mask=[0, 1],
                          logprobs=[None, -0.1], turn_policy_versions=[0], turn_spans=[(1, 2)], reward=1.0,
                          resolved=True, stop_reason="finish", num_turns=1, prompt_length=1)

    async def scenario():
        for cls in (SinkActor, LearnerActor):
            a = cls(s)
            await a.setup()
            await a.handle(traj("rZ-g0-s0"), meta(0))
            await a.handle(traj("rZ-g0-s0"), meta(1))  # a duplicate at a new offset
            await a.handle(traj("other-run-g0-s0"), meta(2))
            b = cls(s)  # restarted worker
            await b.setup()
            await b.handle(traj("rZ-g0-s0"), meta(0))  # redelivered
            await b.handle(traj("rZ-g0-s1"), meta(3))
        lines = (s.run_dir / "trajectories.jsonl").read_text().splitlines()
        assert len(lines) == 2
        assert len((s.run_dir / "learner-records.jsonl").read_text().splitlines()) == 2

    run(scenario())


def test_init_skips_requests_past_deadline(tmp_path):
    s = services(tmp_path)

    async def scenario():
        init = InitActor(s)
        await init.setup()
        old = InitRequest(episode=EpisodeKey(episode_id="e", group_id="g", task_id="toy-000"), issued_at=0.0, deadline=1.0)
        assert await init.handle(old, meta()) == []
        now = time.time()
        fresh = InitRequest(episode=EpisodeKey(episode_id="f", group_id="g", task_id="toy-000"), issued_at=now, deadline=now + 60,
                            final_wave=True)
        (out,) = await init.handle(fresh, meta())
        assert out.value.turn == 0 and out.value.final_wave, "the final-wave mark reaches the agent"
        await (await s.sandboxes.attach(out.value.sandbox)).destroy()

    run(scenario())


def test_unknown_task_is_an_error_naming_the_task(tmp_path):
    s = services(tmp_path)
    with pytest.raises(KeyError, match="toy-999"):
        s.taskset.get("toy-999")


def test_reward_grades_once_per_attempt_and_cleans_up_duplicates(tmp_path):
    s = services(tmp_path)

    async def scenario():
        traj = await play_episode(s, episode_id="r1-g0-s3")
        reward = RewardActor(s)
        reward.ledger.record("r1-g0-s3/0", meta())  # graded long ago: no trajectory kept
        from rollway.sandboxes.base import SandboxSpec

        dup_box = await s.sandboxes.create(SandboxSpec(files={"x": "1"}), "dup-r1-g0-s3")
        req = RewardRequest(episode=EpisodeKey(episode_id="r1-g0-s3", group_id="r1-g0", task_id="toy-001"), sandbox=dup_box.handle,
                            prompt_ids=[], messages=[], turns=[], stop_reason="finish")
        assert await reward.handle(req, meta()) == []
        assert not Path(dup_box.workspace_path).exists()
        return traj

    assert run(scenario()).reward == 1.0


def test_agent_step_for_unknown_history_without_log_is_an_error(tmp_path):
    s = services(tmp_path)
    step = AgentStep(episode=EpisodeKey(episode_id="e", group_id="g", task_id="toy-000"), turn=2, sandbox={}, start_offset=0)
    with pytest.raises(RuntimeError, match="rebuild"):
        run(AgentActor(s).handle(step, meta()))


def test_sink_writes_parquet_for_other_trainers(tmp_path):
    from rollway.learning.export import read_rows

    s = services(tmp_path, "sink.format=parquet", "run.id=r1")

    async def scenario():
        traj = await play_episode(s, episode_id="r1-g0-s7")
        sink = SinkActor(s)
        await sink.setup()
        await sink.handle(traj, meta())
        await sink.close()
        return traj

    traj = run(scenario())
    [row] = read_rows(tmp_path / "run" / "trajectories.parquet")
    assert row["episode_id"] == "r1-g0-s7" and row["reward"] == 1.0
    assert row["prompt_ids"] == traj.token_ids[: traj.prompt_length]
    assert row["prompt_ids"] + row["response_ids"] == traj.token_ids
    assert len(row["response_loss_mask"]) == len(row["response_ids"])


def test_scheduler_runs_at_most_max_policy_lag_updates_ahead_of_a_training_learner(tmp_path):
    s = services(tmp_path, "tasks.count=4", "scheduler.group_size=2", "scheduler.max_inflight_episodes=100",
                 "scheduler.max_policy_lag=1", "learner.type=ppo", "learner.groups_per_step=1", "run.id=rW")

    async def scenario():
        sched = SchedulerActor(s)
        await sched.setup()
        first = await sched.tick()
        assert len(first) == 4  # updates 0 and 1 (2 episodes each) may be in flight at version 0
        assert await sched.tick() == []
        await sched.handle(PolicyVersion(version=1, episodes_trained=2), meta())
        # The lag rule on in-flight episodes holds until the version-0 episodes finish...
        for t in sched.tickets.values():
            if t.state == "inflight":
                t.state = "completed"
        assert len(await sched.tick()) == 2  # ...then exactly one more update's worth is released
        assert await sched.tick() == []
        # An update skipped for lack of signal keeps the version but still releases work.
        await sched.handle(PolicyVersion(version=1, episodes_trained=4), meta())
        assert len(await sched.tick()) == 2

    run(scenario())


def test_next_user_message_sees_the_turn_that_just_ran(tmp_path):
    """The old hook (served by `HookedEnvironment`, with its deprecation warning): its episode ends with the turn
    that just ran, in `turns` as in `messages` (a simulated user reading `turns` advanced one turn early when
    the record was added after the call)."""
    s = services(tmp_path)
    seen = []

    async def record_view(task, episode):
        last = episode.turns[-1]
        seen.append((len(episode.turns), last.turn, last.assistant_text == episode.messages[-1 - len(
            last.observations)]["content"], [o.tool for o in last.observations]))
        return None

    s.taskset.next_user_message = record_view
    with pytest.warns(DeprecationWarning, match="defines next_user_message"):
        traj = run(play_episode(s))
    assert [n for n, *_ in seen] == [turn + 1 for _, turn, *_ in seen]
    assert [turn for _, turn, *_ in seen] == list(range(len(seen))) and len(seen) == traj.num_turns - 1
    assert all(same for _, _, same, _ in seen)
    assert [tools for *_, tools in seen] == [[o.tool for o in u.observations] for u in traj.turns[:-1]]


def test_the_scripted_policy_goes_on_with_its_script_after_a_simulated_user_message(tmp_path):
    """`turns[k]` is the episode's turn k: a simulated user's message between turns does not restart
    the script (it did: the policy counted assistant turns since the last user message)."""
    from rollway.envs.base import Environment

    s = services(tmp_path)

    class UserAfterEachTurn(Environment):
        async def step(self, output, episode):
            step = await super().step(output, episode)
            if not (step.done or episode.stop_reason):
                step.user_message = "Please go on."
            return step

    s.taskset.environment_class = UserAfterEachTurn
    traj = run(play_episode(s))
    script = s.cfg.policy.script[0].turns
    assert [t.assistant_text for t in traj.turns] == script[:len(traj.turns)]
    assert traj.reward == 1.0 and traj.num_turns == len(script)


def test_task_set_hints_end_the_observation_the_model_reads_next(tmp_path):
    """The environment's hints (`Step.hints`) after each turn's observations are recorded as the turn's hints and
    end the observation the next turn's prompt carries (scripted policy: the fake model)."""
    from rollway.envs.base import Environment

    s = services(tmp_path, "hints.budget_reminders=false")
    seen = []

    class HintAfterTools(Environment):
        async def step(self, output, episode):
            step = await super().step(output, episode)
            if step.done or episode.stop_reason:
                return step
            observations = step.observations
            seen.append([o.tool for o in observations])
            step.hints = [f"hint after {observations[0].tool}"] if observations and observations[0].tool else []
            return step

    s.taskset.environment_class = HintAfterTools
    traj = run(play_episode(s))
    assert seen == [[o.tool for o in u.observations] for u in traj.turns[:-1]]
    first = traj.turns[0]
    assert first.hints == [f"hint after {first.observations[0].tool}"]
    assert f"hint after {first.observations[0].tool}" in s.chat.decode(traj.token_ids)


def test_a_turn_runs_without_any_transport(tmp_path):
    """The built-in loop (actors/turn.py) plays a whole episode from the turn-0 message alone: no broker,
    no actor, no log; the scripted policy solves the toy task and the reward stage grades it 1."""
    from rollway.actors.turn import TurnRunner
    from rollway.episode.state import EpisodeState

    s = services(tmp_path)
    init, reward = InitActor(s), RewardActor(s)
    req = InitRequest(episode=EpisodeKey(episode_id="r1-g0-s0", group_id="r1-g0", task_id="toy-001"),
                      issued_at=time.time(), deadline=time.time() + 60)
    [first] = run(init.handle(req, MessageMeta("init-requests", 0, 0)))
    state, runner = EpisodeState.start(first.value, 0), TurnRunner.from_services(s)

    async def play():
        sandbox = await s.sandboxes.attach(first.value.sandbox)
        while True:
            record, stop, failure = await runner.run(state, lambda turn: _same(sandbox))
            assert failure is None
            state.apply(record, [])
            if stop is not None:
                return stop

    async def _same(sandbox):
        return sandbox

    assert run(play()) == "finish" and len(state.turns) == 4
    request = RewardRequest(episode=first.value.episode, sandbox=first.value.sandbox, prompt_ids=first.value.prompt_ids,
                            messages=first.value.messages, turns=state.turns, stop_reason="finish")
    [out] = run(reward.handle(request, MessageMeta("reward-requests", 0, 0)))
    assert out.value.reward == 1.0 and out.value.token_ids[: len(first.value.prompt_ids)] == first.value.prompt_ids
