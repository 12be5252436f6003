"""Launched inference servers (policies/launch.py) are restarted when they stop serving, not only when their
process exits. Real parts: rollway's built-in CPU engine serving SmolLM2."""

from __future__ import annotations

import os
import signal
import time

import pytest

from rollway.base.http import http_ok
from rollway.policies import launch
from rollway.policies.config import PolicyConfig


def test_a_server_that_lives_on_but_answers_nothing_is_replaced(tmp_path, monkeypatch):
    """A stopped server (SIGSTOP: its process alive, its port silent) is what vLLM's API server looked like
    after its engine core died: `restart_dead` must replace it, as it replaces one that exited."""
    monkeypatch.setattr(launch, "HEALTH_EVERY_S", 0.2)
    monkeypatch.setattr(launch, "HEALTH_TIMEOUT_S", 0.5)
    engine = launch.launch_engine(PolicyConfig(type="openai", launch=True, engine="builtin", model="smollm2",
                                               threads=1), tmp_path)
    try:
        (server,) = engine.servers
        old_pid, port = server.proc.pid, server.port
        assert engine.restart_dead(None) == [] and server.healthy()  # a serving server is left alone
        os.kill(old_pid, signal.SIGSTOP)
        notes: list[str] = []
        deadline = time.monotonic() + 60
        while not notes and time.monotonic() < deadline:
            notes = engine.restart_dead(None)
            time.sleep(0.1)
        assert notes and "stopped answering /health" in notes[0], notes
        (new,) = engine.servers
        assert new.proc.pid != old_pid and new.port == port and http_ok(f"http://127.0.0.1:{port}/health")
        assert not os.path.exists(f"/proc/{old_pid}") or open(f"/proc/{old_pid}/stat").read().split()[2] == "Z"
    finally:
        engine.stop()


def _serving(port: int) -> bool:
    """Whether a connection to the server on `port` is open (a completion in flight: nothing else talks to
    it here): an established socket whose local end is that port."""
    rows = [line.split() for line in open("/proc/net/tcp").read().splitlines()[1:]]
    return any(r[1].endswith(f":{port:04X}") and r[3] == "01" for r in rows)


@pytest.mark.slow
def test_a_completion_cut_short_by_a_restart_of_the_engine_is_infrastructure(tmp_path):
    """The real built-in engine (`rollway serve`, SmolLM2) killed while it generates a completion, as a
    restart does. Not back (no retry here): ConnectionError, caused by the answer cut short (an OSError, which the agent stage
    and the gateway turn into a retried `InferenceUnreachable`, never a 0 for the episode: base/blame.py).
    Restarted by the watchdog (`restart_dead`) while the client retries: the completion is answered. The raw
    socket stand-in of tests/test_blame.py shows the same for a body cut in half."""
    import asyncio

    import aiohttp

    from rollway.policies.base import SamplingParams
    from rollway.policies.openai_client import OpenAICompletionsClient

    engine = launch.launch_engine(PolicyConfig(type="openai", launch=True, engine="builtin", model="smollm2",
                                               threads=1), tmp_path)
    params = SamplingParams(max_tokens=64, ignore_eos=True)  # seconds of generation: killed in the middle

    async def cut(retries: int, restart: bool):
        (server,) = engine.servers
        asking = OpenAICompletionsClient(server.base_url, api_key=engine.api_key)
        model = await asking.model_name()
        await asking.close()
        deadline = time.monotonic() + 120
        while _serving(server.port):  # that connection closed: the next one is the completion's
            assert time.monotonic() < deadline, "the engine kept the model query's connection open"
            await asyncio.sleep(0.02)
        client = OpenAICompletionsClient(server.base_url, model, max_retries=retries, backoff_s=0.5,
                                         api_key=engine.api_key)
        try:
            answer = asyncio.ensure_future(client.generate(list(range(10, 40)), params))
            while not _serving(server.port):
                assert not answer.done() and time.monotonic() < deadline, "the completion never reached the engine"
                await asyncio.sleep(0.02)
            engine.kill(0)
            # In a thread of the loop's pool, which outlives the answer: a server dies with the thread that
            # started it (ServerProcess.die_with_parent).
            restarted = asyncio.ensure_future(asyncio.to_thread(engine.restart_dead, None)) if restart else None
            try:
                return await answer
            finally:
                if restarted is not None:
                    assert (await restarted) and not answer.cancelled()
        finally:
            await client.close()

    try:
        with pytest.raises(ConnectionError, match="failed after 1 attempts") as caught:
            asyncio.run(cut(retries=0, restart=False))
        assert isinstance(caught.value, OSError)  # what actors/turn.py turns into InferenceUnreachable
        cause = caught.value.__cause__  # the answer cut short, not a connection refused before it was asked
        assert isinstance(cause, aiohttp.ClientError) and not isinstance(cause, aiohttp.ClientConnectorError), cause
        engine.restart_dead(None)
        # Retries spaced 0.5 s, 1 s, 2 s, ... (255 s in all): the restart (a model load) is back within them.
        answer = asyncio.run(cut(retries=8, restart=True))
        assert len(answer.token_ids) == 64 and len(answer.logprobs) == 64
    finally:
        engine.stop()
