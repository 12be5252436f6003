"""Harness episodes when the process serving the gateway dies or an attempt ends early: the trained
trajectory holds each captured call once, and only calls of its own attempt. Real bubblewrap jail,
real gateway, real broker (the embedded Tansu of the session) and `rollway chaos`; the scripted
policy is the only fake (it is the model)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import uuid

import pytest
from conftest import ROOT

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

# A program that makes `calls` chat calls through the gateway (stdlib only), opening with `word`, then
# exits with `code`.
CALLER = r"""
import json, os, sys, urllib.request
calls, code, word = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
messages = [{"role": "user", "content": word}]
for _ in range(calls):
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", method="POST",
        data=json.dumps({"model": "m", "messages": messages}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    reply = json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["message"]
    messages += [{"role": "assistant", "content": reply["content"]}, {"role": "user", "content": "again"}]
sys.exit(code)
"""


def _harness(calls: int, code: int, word: str):
    from rollway.gateway.config import HarnessConfig

    return HarnessConfig(command=["python3", "-c", CALLER, str(calls), str(code), word], time_limit_s=60,
                         silence_limit_s=60)


@pytest.mark.broker
@pytest.mark.parametrize("ending", ["crash", "cancelled"])
def test_a_later_attempt_on_the_same_worker_gets_only_its_own_calls(tmp_path, broker, topic_prefix, ending):
    """Attempt 0 records 3 calls and then crashes (or its handler is cancelled, as on a rebalance);
    attempt 1 of the same episode, on the same worker's gateway, makes 2 calls. Its outcome must be
    its own 2 calls: before, the worker kept acknowledged calls by episode id and dropped them only
    when an attempt ended normally, so attempt 1 was built from attempt 0's calls."""
    from rollway.actors.harness import HarnessCrashed, HarnessRunner, KeepingRecorder
    from rollway.core.config import RunConfig
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
            if ending == "crash":
                with pytest.raises(HarnessCrashed, match="exited with code 3"):
                    await first.play(key, "count", box0, [])
            else:
                play = asyncio.create_task(HarnessRunner(_harness(3, 0, "first"), gateway, recorder).play(
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
    assert outcome.stop_reason == "harness_exit"
    live = chat.encode("live") + list(chat.stop_token_ids[:1])
    assert [t.completion_ids for t in outcome.turns] == [live, live]
