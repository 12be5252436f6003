"""Agent actor: one message = one turn. The turn itself (generate, step, record) is actors/turn.py over the
episode package; this actor delivers it: caches episodes, rebuilds them from the log, drops duplicates,
claims each turn in its sandbox, emits the next turn or the finished episode."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from functools import cached_property

import msgspec
import structlog

from rollway.actors.reward import refused_as_graded_0
from rollway.actors.services import Services
from rollway.actors.sink import belongs_to_run
from rollway.actors.turn import TurnRunner
from rollway.base.blame import AGENT_FAILURE, InfrastructureFailure, blame, failure_details, failure_reason
from rollway.episode.state import EpisodeState
from rollway.runtime.actor import Actor, MessageMeta, Output, OutputRefused, StaleMessage, failure_output
from rollway.sandboxes.base import SandboxGone
from rollway.schemas.messages import AgentStep, RewardRequest
from rollway.topics import AGENT_STEPS, REWARD_REQUESTS

log = structlog.get_logger()

LogReader = Callable[[str, int, int, str], Awaitable[list[tuple[int, AgentStep]]]]
"""(topic, partition, from_offset, episode_id) -> [(offset, message)] of that episode, from
`from_offset` to the current end of the partition."""

MAX_CACHED_EPISODES = 4096


class AgentActor(Actor):

    def __init__(self, services: Services, read_log: LogReader | None = None):
        self.s = services
        self.cfg = services.cfg.agent
        self.read_log = read_log
        self.cache: OrderedDict[tuple[str, int], EpisodeState] = OrderedDict()
        self.final_wave = False
        """Set by the first final-wave message this worker sees: the run is draining."""
        self._harness = None
        """The harness runner and its gateway (actors/harness.py), started by the first harness episode."""
        self._harness_lock = asyncio.Lock()

    @cached_property
    def turns(self) -> TurnRunner:
        """The transport-free turn (actors/turn.py), built on first use from the services."""
        return TurnRunner.from_services(self.s)

    async def setup(self) -> None:
        # Build now, task set first (it imports the module that defines its tools): fail fast on bad config.
        _ = self.s.toolbox.build(self.s.taskset.default_tools), self.s.inference, self.s.sandboxes

    async def _handle_turn(self, msg: AgentStep, meta: MessageMeta) -> list[Output]:
        state = await self._state_for(msg, meta)
        if state is None:
            return []  # duplicate delivery of a turn that was already run
        if self.cfg.harness is not None:
            return await self._harness_episode(state)
        record, stop_reason, failure = await self.turns.run(state, lambda turn: self._sandbox_for_turn(state, turn),
                                                            lambda: self._rank(msg.turn))
        state.apply(record)
        if stop_reason is None:
            return [Output(AGENT_STEPS, msg.episode_id, state.next_step())]
        self.cache.pop((msg.episode_id, msg.attempt), None)
        return [Output(REWARD_REQUESTS, msg.episode_id, state.reward_request(stop_reason, failure))]

    def priority(self, msg: AgentStep) -> float:
        """With a backlog, later turns first: finish running episodes (and free their sandboxes)
        before starting new ones. Once the run drains (the first final-wave message), earliest turn
        first, for every episode: nothing is left to issue, the run ends when its longest remaining
        episode does, and the episodes with the fewest turns done have the most left. Episodes
        issued just before the final wave are no different from those in it: ranking only marked
        messages first left their first turns waiting seconds behind the wave."""
        if msg.final_wave and not self.final_wave:
            self.final_wave = True
            self.priority_epoch += 1  # the runtime re-ranks what it already queued
        return self._rank(msg.turn)

    def _rank(self, turn: int) -> float:
        return -float(turn) if self.final_wave else float(turn)

    async def handle(self, msg: AgentStep, meta: MessageMeta) -> list[Output]:
        if not belongs_to_run(msg.episode_id, self.s.cfg.run.id):
            return []  # another run's episode on shared topics (its sandbox is not ours to touch)
        try:
            return await self._handle_turn(msg, meta)
        except TurnReplayed as err:
            log.warning("turn re-run detected; attempt failed for a fresh sandbox", episode_id=msg.episode_id,
                        turn=msg.turn, attempt=msg.attempt)
            self.cache.pop((msg.episode_id, msg.attempt), None)
            await self._destroy_sandbox(msg)
            return [failure_output(msg, self.name, err)]
        except SandboxGone as err:
            # Only an ended attempt's sandbox is destroyed: this turn is a redelivery (say, the last
            # turn, graded and torn down before its offset was committed). Nothing needs a person.
            self.cache.pop((msg.episode_id, msg.attempt), None)
            raise StaleMessage(f"turn {msg.turn} of attempt {msg.attempt}: {err}") from None
        except Exception as err:
            graded = self._graded_failure(msg, err)
            if graded is not None:
                return graded  # the agent's failure: graded 0 (the reward stage tears the sandbox down)
            # The attempt fails (on_error reports it; the scheduler re-issues it in a fresh sandbox):
            # nothing will use this sandbox again. A cancelled turn keeps it: its message is
            # redelivered and the episode goes on there.
            await self._destroy_sandbox(msg)
            raise

    def _graded_failure(self, msg: AgentStep, err: Exception) -> list[Output] | None:
        """A turn > 0 of a built-in episode failed before its tool calls (say, its sandbox found dead):
        earlier turns ran the agent's tool calls there, so unless `blame` finds the infrastructure, the
        episode ends with the turns so far, graded 0 (None: not the agent's, the attempt fails)."""
        state = self.cache.get((msg.episode_id, msg.attempt))
        if state is None or not state.turns or blame(err, agent_ran=msg.turn > 0) == "infrastructure":
            return None
        self.cache.pop((msg.episode_id, msg.attempt), None)
        log.warning("episode failed after the agent's tool calls ran; graded 0", episode_id=msg.episode_id,
                    turn=msg.turn, error=failure_reason(err)[:300])
        request = state.reward_request(AGENT_FAILURE, failure_details(err, self.name))
        # The last turn was not the final one: the observation tokens after it were never generated on.
        request.turns[-1] = msgspec.structs.replace(request.turns[-1], observation_ids=[])
        return [Output(REWARD_REQUESTS, msg.episode_id, request)]

    async def _destroy_sandbox(self, msg: AgentStep) -> None:
        """Destroy the attempt's sandbox; one already gone (or unreachable) is logged, never raised
        over the error that failed the turn."""
        try:
            await (await self.s.sandboxes.attach(msg.sandbox)).destroy()
        except Exception as err:  # noqa: BLE001 - the turn's own error is the one to report
            log.warning("sandbox of a failed attempt not destroyed; the run's reaper will", episode_id=msg.episode_id,
                        attempt=msg.attempt, error=f"{type(err).__name__}: {err}")

    def on_error(self, msg: AgentStep, error: BaseException) -> list[Output]:
        """`handle` has destroyed the sandbox already (on_error is not async). A turn's or an episode's
        message the broker cannot take is the agent's (what it wrote made it so): graded 0, cut to fit."""
        state = self.cache.pop((msg.episode_id, msg.attempt), None)
        refused = error.output.value if isinstance(error, OutputRefused) and error.output is not None else None
        if isinstance(refused, AgentStep) and state is not None:
            refused = state.reward_request(AGENT_FAILURE)
        request = refused_as_graded_0(refused, error, self.name) if isinstance(refused, RewardRequest) else None
        if request is not None:
            return [Output(REWARD_REQUESTS, msg.episode_id, request)]
        return [failure_output(msg, self.name, error)]

    # -- state ------------------------------------------------------------------------------
    async def _state_for(self, msg: AgentStep, meta: MessageMeta) -> EpisodeState | None:
        key = (msg.episode_id, msg.attempt)
        state = self.cache.get(key)
        if msg.turn == 0 and state is None:
            state = EpisodeState.start(msg, meta.offset)
            if self.read_log is not None and await self._already_advanced(msg, meta, meta.offset):
                await self._discard_duplicate_sandbox(msg, None)
                return None
        elif state is None or state.next_turn != msg.turn:
            if state is not None and state.next_turn > msg.turn:
                await self._discard_duplicate_sandbox(msg, state)
                return None
            state = await self._rebuild(msg, meta)
            if state is None:
                return None
        self.cache[key] = state
        self.cache.move_to_end(key)
        while len(self.cache) > MAX_CACHED_EPISODES:
            self.cache.popitem(last=False)
        return state

    async def _discard_duplicate_sandbox(self, msg: AgentStep, state: EpisodeState | None) -> None:
        """A second turn-0 of one attempt (init redelivered after a crash) came with its own sandbox;
        the episode goes on in the first one, so this one would leak."""
        if msg.turn == 0 and (state is None or msg.sandbox != state.first.sandbox):
            await (await self.s.sandboxes.attach(msg.sandbox)).destroy()
            log.info("duplicate turn 0 dropped", episode_id=msg.episode_id, attempt=msg.attempt)

    async def _already_advanced(self, msg: AgentStep, meta: MessageMeta, start: int) -> bool:
        """True when the log already holds a later turn of this attempt (we crashed after producing
        it but before committing): running the turn again would repeat its tool calls."""
        later = await self.read_log(meta.topic, meta.partition, start, msg.episode_id)
        return any(m.attempt == msg.attempt and m.turn > msg.turn for _, m in later)

    async def _rebuild(self, msg: AgentStep, meta: MessageMeta) -> EpisodeState | None:
        """Replay this attempt's turn messages from its turn-0 offset (another worker ran them)."""
        if self.read_log is None or msg.start_offset is None:
            raise RuntimeError(f"episode {msg.episode_id} turn {msg.turn} arrived without its history "
                               "and this worker cannot read the log to rebuild it")
        events = [(o, m) for o, m in await self.read_log(meta.topic, meta.partition, msg.start_offset,
                                                          msg.episode_id) if m.attempt == msg.attempt]
        if any(m.turn > msg.turn for _, m in events):
            return None
        by_turn = {m.turn: (o, m) for o, m in events if m.turn <= msg.turn}
        if 0 not in by_turn:
            raise RuntimeError(f"episode {msg.episode_id}: turn-0 message not found at offset {msg.start_offset}")
        state = EpisodeState.start(by_turn[0][1], by_turn[0][0])
        for turn in range(1, msg.turn + 1):
            step = by_turn[turn][1]
            state.apply(step.last)
        log.info("episode rebuilt from log", episode_id=msg.episode_id, turn=msg.turn)
        return state

    # -- the turn itself (actors/turn.py) ---------------------------------------------------
    async def _sandbox_for_turn(self, state: EpisodeState, turn: int):
        """The episode's sandbox, claimed for `turn`: a turn whose tool calls already started once (a crash
        or rebalance before its produce) must not run them again."""
        sandbox = await self.s.sandboxes.attach(state.first.sandbox)
        if not await sandbox.claim_turn(f"a{state.first.attempt}-t{turn}"):
            await sandbox.destroy()
            raise TurnReplayed(f"episode {state.first.episode_id} attempt {state.first.attempt} turn {turn} already "
                               "ran its tool calls once (a crash or rebalance before its produce); the sandbox was "
                               "destroyed and the attempt fails so the scheduler re-issues it in a fresh sandbox")
        return sandbox

    # -- harness episodes (actors/harness.py) -----------------------------------------------
    async def _harness_episode(self, state: EpisodeState) -> list[Output]:
        """Turn 0 of a harness episode is the whole episode: the program runs to its end or a limit."""
        f = state.first
        state.begin(self.s.taskset.get(f.task_id), self.s.cfg.scheduler.agent_time_s)
        runner = await self._harness_runner()
        sandbox = await self._sandbox_for_turn(state, 0)  # claimed: a redelivery never starts it twice
        outcome = await runner.play(f.episode, state.task.prompt, sandbox, list(f.prompt_ids or []), state.deadline)
        self.cache.pop((f.episode_id, f.attempt), None)
        request = msgspec.structs.replace(state.reward_request(outcome.stop_reason, outcome.failure), turns=outcome.turns,
                                          prompt_ids=outcome.prompt_ids, side_calls=outcome.side_calls,
                                          messages=outcome.messages or list(f.messages or []))
        return [Output(REWARD_REQUESTS, f.episode_id, request)]

    async def _harness_runner(self):
        """This worker's gateway (one per process, in front of its inference client), started on first use."""
        async with self._harness_lock:
            if self._harness is None:
                from rollway.actors.harness import start_harness_runner

                bootstrap = getattr(self.read_log, "bootstrap", None) or self.s.cfg.broker.bootstrap
                self._harness = await start_harness_runner(self.s, bootstrap)
            return self._harness

    async def close(self) -> None:
        if self._harness is not None:
            await self._harness.close()
            self._harness = None


class TurnReplayed(InfrastructureFailure):
    """A turn's tool calls already started once in this sandbox: running them again could apply them
    twice (a non-idempotent edit, a second `git commit`). Infrastructure (base/blame.py): the first run
    was cut by a worker crash or a rebalance, and the marks live where the agent cannot make them."""
