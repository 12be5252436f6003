"""vLLM launch command, request/response mapping and policy config without a server (the real server's
tests are in test_vllm_server.py)."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from rollway.policies.base import SamplingParams
from rollway.policies.config import PolicyConfig
from rollway.policies.factory import build_inference
from rollway.policies.openai_client import (
    OpenAICompletionsClient,
    builtin_weight_update_calls,
    completion_payload,
    parse_completion,
)
from rollway.policies.vllm import (
    VLLMClient,
    generate_payload,
    parse_generate,
    version_of,
    vllm_serve_command,
    vllm_serve_env,
    vllm_serve_shell,
)


def test_vllm_command_has_the_rl_flags():
    cmd = vllm_serve_command("Qwen/Qwen3-0.6B", port=8001, served_model_name="policy", max_model_len=8192,
                             python="/x/bin/python", enforce_eager=True, guarded=True)
    assert cmd[:5] == ["/x/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "Qwen/Qwen3-0.6B"]
    flags = " ".join(cmd)
    for flag in ("--port 8001", "--enable-scale-out", "--return-tokens-as-token-ids",
                 "--logprobs-mode processed_logprobs", "--generation-config vllm", "--served-model-name policy",
                 "--max-model-len 8192", "--enforce-eager", "--middleware rollway_vllm_guard.RequireKey"):
        assert flag in flags
    assert "--api-key" not in flags  # the key goes by environment: argv is visible to every user in `ps`
    keyed = vllm_serve_env(api_key="sk-secret-1")
    assert keyed["VLLM_API_KEY"] == "sk-secret-1"
    assert keyed["PYTHONPATH"].split(":")[0].endswith("policies/vllm_plugins")
    keyless = vllm_serve_env()  # no key to hand over; the plugin folder still goes (its sitecustomize mend)
    assert "VLLM_API_KEY" not in keyless and keyless["VLLM_SERVER_DEV_MODE"] == "1"
    assert keyless["PYTHONPATH"].split(":")[0].endswith("policies/vllm_plugins")
    assert vllm_serve_env(1.5)["VLLM_CPU_KVCACHE_SPACE"] == "1.5"
    shell = vllm_serve_shell("m")
    assert shell.startswith("VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 PYTHONPATH=")
    path = shell.split(" PYTHONPATH=", 1)[1].split(" ", 1)[0]  # the plugins first, then whatever the caller had
    assert path.split(":")[0].endswith("/policies/vllm_plugins")
    assert f"PYTHONPATH={path} python -m vllm.entrypoints.openai.api_server " in shell


def test_builtin_weight_update_calls():
    calls = builtin_weight_update_calls("/ckpt/step_5", 5)
    assert calls[0] == ("POST", "/collective_rpc",
                        {"method": "update_config", "args": [{"model_config": {"model": "/ckpt/step_5"}}]})
    assert calls[1][1] == "/collective_rpc" and calls[1][2]["method"] == "reload_weights"
    assert calls[1][2]["policy_version"] == 5 and calls[2][1] == "/reset_prefix_cache"


def test_generate_payload_and_weight_version_spans():
    body = generate_payload("m", [1, 2], SamplingParams(0.7, 0.9, 8, (2,), seed=3))
    assert body["token_ids"] == [1, 2] and body["output_mode"] == "tokens"
    assert body["sampling_params"] == {"temperature": 0.7, "top_p": 0.9, "max_tokens": 8, "stop_token_ids": [2],
                                       "logprobs": 0, "detokenize": False, "seed": 3}
    answer = {"choices": [{"token_ids": [5, 6, 2], "finish_reason": "stop",
                           "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in (5, 6, 2)]},
                           "weight_versions": [{"version": "3", "start": 0, "end": 1},
                                               {"version": "4", "start": 1, "end": 3}]}]}
    gen = parse_generate(answer)
    assert (gen.token_ids, gen.logprobs, gen.finish_reason) == ([5, 6, 2], [-0.5] * 3, "stop")
    assert gen.policy_version == 3  # mixed spans: the oldest version rules staleness
    assert version_of("default") == 0 and version_of("12") == 12
    with pytest.raises(ValueError, match="update_weight_version"):
        version_of("v1-final")


def test_vllm_client_prefers_the_least_loaded_live_replica():
    client = VLLMClient(["http://a:1/v1", "http://b:2/v1"])
    client._inflight["http://a:1"] = 3
    assert client._pick() == "http://b:2"
    client._dead_until["http://b:2"] = float("inf")
    assert client._pick() == "http://a:1"


def test_completion_payload_asks_for_token_ids_and_logprobs():
    body = completion_payload("m", [1, 2, 3], SamplingParams(0.8, 0.9, 32, (2,), seed=4))
    assert body["prompt"] == [1, 2, 3] and body["logprobs"] == 0 and body["stop_token_ids"] == [2]
    assert body["return_tokens_as_token_ids"] and body["return_token_ids"] and body["seed"] == 4
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.8, 0.9, 32)
    assert "ignore_eos" not in body  # a plain OpenAI endpoint may refuse a field it does not know


def test_completion_payload_carries_ignore_eos():
    """Asked to generate past the end-of-sequence token (a fixed-length turn: benchmarks, a test that needs
    seconds of generation), the completions client says so: it used to drop the flag, so such a turn ended
    at the model's first EOS (a watchdog test got 17 of its 64 tokens)."""
    from rollway.policies.chat import BytesChatML
    from rollway.policies.openai_chat import OpenAIChatClient

    params = SamplingParams(max_tokens=64, ignore_eos=True)
    body = completion_payload("m", [1, 2, 3], params)
    assert body["ignore_eos"] is True and body["max_tokens"] == 64
    chat = OpenAIChatClient("http://127.0.0.1:9/v1", BytesChatML(), "m")
    prompt = [256, *b"user\nhi", 257, *b"\n", 256, *b"assistant\n"]  # ChatML in BytesChatML's ids
    assert chat.payload("m", prompt, params)["ignore_eos"] is True
    assert "ignore_eos" not in chat.payload("m", prompt, SamplingParams())


def test_parse_completion_reads_vllm_shapes():
    old_vllm = {"choices": [{"text": "hi", "finish_reason": "stop",
                             "logprobs": {"tokens": ["token_id:5", "token_id:2"], "token_logprobs": [-0.5, -0.1]}}]}
    gen = parse_completion(old_vllm, fallback_version=3)
    assert gen.token_ids == [5, 2] and gen.logprobs == [-0.5, -0.1] and gen.policy_version == 3
    new_vllm = {"choices": [{"token_ids": [7], "finish_reason": "length",
                             "logprobs": {"tokens": ["x"], "token_logprobs": [-1.0]}}], "policy_version": 9}
    gen = parse_completion(new_vllm, fallback_version=3)
    assert (gen.token_ids, gen.finish_reason, gen.policy_version) == ([7], "length", 9)
    with pytest.raises(ValueError, match="logprobs"):
        parse_completion({"choices": [{"token_ids": [1], "logprobs": None}]}, 0)


def test_policy_config_builds_the_openai_client():
    cfg = PolicyConfig(type="openai", base_url="http://127.0.0.1:8000/v1/", model="m", request_timeout_s=5)
    client = build_inference(cfg, chat=None)
    assert isinstance(client, OpenAICompletionsClient)
    assert client.base_url == "http://127.0.0.1:8000/v1" and client.root_url == "http://127.0.0.1:8000"
    with pytest.raises(ValidationError, match="base_url"):
        PolicyConfig(type="openai")
    with pytest.raises(ValidationError):
        PolicyConfig(type="openai", base_url="http://x/v1", temperature=1.0)  # unknown keys are errors


def test_the_tokenizer_is_never_silently_the_bundled_one_for_another_served_model():
    from rollway.policies.factory import tokenizer_source

    # A served name that is not a local model and no reachable server: an error asks for policy.tokenizer.
    with pytest.raises(ValueError, match="policy.tokenizer"):
        tokenizer_source(PolicyConfig(type="openai", base_url="http://127.0.0.1:9/v1", model="served-name",
                                      chat_format="hf", max_retries=0))
    named = PolicyConfig(type="openai", base_url="http://x/v1", model="served-name", tokenizer="smollm2")
    assert tokenizer_source(named) == "smollm2"
    assert tokenizer_source(PolicyConfig(type="openai", launch=True, model="smollm2")) == "smollm2"


def test_api_key_is_sent_and_masked(monkeypatch):
    from rollway.config.run import RunConfig, dump_config

    cfg = PolicyConfig(type="openai", base_url="http://x/v1", api_key="sk-123")
    client = build_inference(cfg, chat=None)
    assert client.headers == {"Authorization": "Bearer sk-123"}
    assert "sk-123" not in str(dump_config(RunConfig.model_validate({"policy": cfg.model_dump()})))
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    assert PolicyConfig(type="openai", base_url="http://x/v1").api_key_value() == "sk-env"


def test_engine_choice_and_replica_urls():
    cfg = PolicyConfig(type="openai", engine="vllm", base_url="http://a:1/v1, http://b:2/v1")
    assert cfg.base_urls() == ["http://a:1/v1", "http://b:2/v1"]
    assert isinstance(build_inference(cfg, chat=None), VLLMClient)
    with pytest.raises(ValidationError, match="api=chat"):
        PolicyConfig(type="openai", launch=True, api="chat")


def test_chat_mode_turns_chatml_prompts_into_messages():
    from rollway.policies.chat import BytesChatML
    from rollway.policies.openai_chat import NOT_TRAINABLE_VERSION, OpenAIChatClient, chatml_messages

    chat = BytesChatML()
    ids = chat.initial([{"role": "user", "content": "2 + 2?"}], [])
    client = build_inference(PolicyConfig(type="openai", base_url="http://x/v1", api="chat"), chat)
    assert isinstance(client, OpenAIChatClient)
    messages = client.payload("m", ids, SamplingParams(max_tokens=5))["messages"]
    assert messages[-1] == {"role": "user", "content": "2 + 2?"} and all(m["content"] for m in messages)
    assert chatml_messages("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n") == [
        {"role": "user", "content": "hi"}]
    assert NOT_TRAINABLE_VERSION < 0


def test_turns_of_an_episode_stick_to_the_replica_that_holds_its_prefix():
    client = VLLMClient(["http://a:1/v1", "http://b:2/v1"], sticky_slack=2)
    first_turn = [1, 2, 3]
    client.affinity.remember(first_turn + [7, 8], "http://b:2")  # prompt + completion served by b
    next_turn = first_turn + [7, 8, 9, 9]  # + observation
    client._inflight["http://b:2"] = 2
    assert client._pick(next_turn) == "http://b:2"  # busier, but within the slack
    client._inflight["http://b:2"] = 3
    assert client._pick(next_turn) == "http://a:1"  # too busy: least-loaded wins
    assert client._pick([5, 5]) == "http://a:1"  # a new episode: least-loaded
    client._dead_until["http://b:2"] = float("inf")
    client._inflight["http://b:2"] = 0
    assert client._pick(next_turn) == "http://a:1"  # a dead replica is never chosen


def test_without_vllm_the_builtin_engine_remains_and_says_how_to_get_vllm(monkeypatch):
    from rollway.policies.launch import resolve_engine

    monkeypatch.setenv("ROLLWAY_VLLM_PYTHON", "/nonexistent/bin/python")
    assert resolve_engine(PolicyConfig(type="openai", launch=True)) == "builtin"
    with pytest.raises(RuntimeError, match="setup-vllm.sh"):
        resolve_engine(PolicyConfig(type="openai", launch=True, engine="vllm"))


def test_with_vllm_installed_auto_launches_vllm():
    from rollway.policies.launch import resolve_engine
    from rollway.policies.vllm import vllm_python

    assert vllm_python() is not None, "scripts/setup-vllm.sh builds .venv-vllm; the setup must have run it"
    assert resolve_engine(PolicyConfig(type="openai", launch=True)) == "vllm"


def _asgi_call(app: type, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, bool]:
    """One HTTP request through an ASGI app: (status sent, whether the inner app was reached)."""
    import asyncio

    sent: list[dict] = []
    reached: list[str] = []

    async def inner(scope, receive, send):  # stands in for vLLM's routes (the real server: test_vllm_server.py)
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    asyncio.run(app(inner)(scope, receive, send))
    return sent[0]["status"], bool(reached)


def test_vllm_guard_wants_the_key_on_dev_routes(monkeypatch):
    """Attack: a process on the host (a task image build, a sandbox with network) calls vLLM's dev route
    /collective_rpc, which vLLM's own key check (only /v1, /v2, /inference, /cohere) lets through."""
    import importlib.util

    from rollway.policies.vllm import GUARD_PATH

    spec = importlib.util.spec_from_file_location("rollway_vllm_guard", GUARD_PATH / "rollway_vllm_guard.py")
    guard = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(guard)
    monkeypatch.setenv("VLLM_API_KEY", "sk-guard-1")
    key = [(b"authorization", b"Bearer sk-guard-1")]
    for path in ("/collective_rpc", "/pause", "/update_weight_version", "/v1/completions", "/tokenize"):
        assert _asgi_call(guard.RequireKey, path, []) == (401, False), path
        assert _asgi_call(guard.RequireKey, path, [(b"authorization", b"Bearer wrong")]) == (401, False), path
        assert _asgi_call(guard.RequireKey, path, key) == (200, True), path
    assert _asgi_call(guard.RequireKey, "/health", []) == (200, True)  # readiness probes need no key
    monkeypatch.delenv("VLLM_API_KEY")
    with pytest.raises(RuntimeError, match="VLLM_API_KEY"):
        guard.RequireKey(None)  # never a guard that lets everything through


def test_url_credentials_become_basic_auth_and_leave_the_url():
    """A password in policy.base_url reaches the server (basic auth) but no URL an error could quote."""
    client = build_inference(PolicyConfig(type="openai", base_url="http://bob:pa%40ss@h:1/v1"), chat=None)
    assert client.base_url == "http://h:1/v1" and "pa" not in client.root_url
    import base64

    assert client.headers == {"Authorization": "Basic " + base64.b64encode(b"bob:pa@ss").decode()}
    keyed = build_inference(PolicyConfig(type="openai", engine="vllm", base_url="http://u:p@h:1/v1", api_key="sk-1"),
                            chat=None)
    assert keyed.roots == ["http://h:1"] and keyed.headers == {"Authorization": "Bearer sk-1"}


def test_a_launched_cpu_engines_readers_spin_a_tenth_of_a_second_not_a_second():
    """In vLLM's own interpreter with the launch environment (its plugin folder on PYTHONPATH, so
    sitecustomize runs first): the shared-memory readers between vLLM's engine core and its worker spin
    0.1 s after a read on this CPU platform, not vLLM's 1 s (two cores spun a second after every answer),
    and look every 0.5 ms with a sleep, not sched_yield; ROLLWAY_VLLM_SPIN_S sets the seconds; writers are
    left alone."""
    import os
    import subprocess

    from rollway.policies.vllm import vllm_python

    python = vllm_python()
    assert python is not None, "scripts/setup-vllm.sh builds .venv-vllm; the setup must have run it"
    # One interpreter per environment (vLLM's import costs about 9 core-seconds): the spin is read from
    # os.environ when a reader is made, so the probe sets ROLLWAY_VLLM_SPIN_S itself between readers.
    probe = ("import os, sys, zmq\n"
             "from vllm.distributed.device_communicators import shm_broadcast\n"
             "from vllm.distributed.device_communicators.shm_broadcast import SpinCondition\n"
             "yields = []\n"
             "shm_broadcast.sched_yield = lambda: yields.append(1)  # counts the spins a wait makes\n"
             "ctx = zmq.Context()\n"
             "for i, value in enumerate(sys.argv[1:]):\n"
             "    os.environ.pop('ROLLWAY_VLLM_SPIN_S', None)\n"
             "    if value != '-':\n"
             "        os.environ['ROLLWAY_VLLM_SPIN_S'] = value\n"
             "    try:\n"
             "        reader = SpinCondition(True, ctx, f'inproc://r{i}')\n"
             "    except ValueError as exc:\n"
             "        print(f'refused:{exc}')\n"
             "        continue\n"
             "    writer = SpinCondition(False, ctx, f'inproc://w{i}')\n"
             "    poll = [getattr(c, '_rollway_poll_s', '-') for c in (reader, writer)]\n"
             "    yields.clear()\n"
             "    reader.record_read()\n"
             "    for _ in range(5):\n"
             "        reader.wait(timeout_ms=1)  # within the spin: a look, no message\n"
             "    print(f'{reader.busy_loop_s}/{writer.busy_loop_s} poll {poll[0]}/{poll[1]} yields {len(yields)}')\n")

    def spins(env: dict[str, str], *values: str) -> list[str]:
        env = {k: v for k, v in env.items() if k != "ROLLWAY_VLLM_SPIN_S"}
        out = subprocess.run([str(python), "-c", probe, *values], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.splitlines()

    launched = spins({**os.environ, **vllm_serve_env()}, "-", "0.5", "-1", "nan", "soon")
    assert launched[:2] == ["0.1/0 poll 0.0005/None yields 0", "0.5/0 poll 0.0005/None yields 0"], launched
    # refused, naming the variable, not a server that stalls or a bare float error
    assert launched[2:] == [f"refused:ROLLWAY_VLLM_SPIN_S must be seconds, 0 or more: {bad!r}"
                            for bad in ("-1", "nan", "soon")], launched
    # Without the plugin folder (a server rollway did not launch): vLLM's own second.
    assert spins({k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "-") == ["1/0 poll -/- yields 5"]


class _StuckVLLM:
    """A stand-in for a vLLM server whose engine stopped working while its HTTP front still answers (fake: an
    aiohttp app, no model; a real engine cannot be made to hang on demand). /v1/models and /is_paused answer,
    /metrics reports the engine's token counters, and a generation is never answered. `working` makes the
    counters move on every scrape (a long generation in progress); `paused` reports a weight update's pause."""

    def __init__(self, working: bool = False, paused: bool = False) -> None:
        self.working, self.paused, self.tokens, self.generations = working, paused, 40.0, 0

    async def start(self) -> str:
        from aiohttp import web

        async def models(_request):
            return web.json_response({"object": "list", "data": [{"id": "m", "max_model_len": 2048}]})

        async def is_paused(_request):
            return web.json_response({"is_paused": self.paused})

        async def metrics(_request):
            self.tokens += 7 if self.working else 0
            return web.Response(text=(
                "# TYPE vllm:prompt_tokens_total counter\n"
                f'vllm:prompt_tokens_total{{engine="0",model_name="m"}} {self.tokens}\n'
                '# TYPE vllm:generation_tokens_total counter\n'
                f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {self.tokens / 2}\n'
                'vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e9\n'))

        async def generate(_request):
            self.generations += 1
            await asyncio.Event().wait()  # never answered

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_get("/is_paused", is_paused)
        app.router.add_get("/metrics", metrics)
        app.router.add_post("/inference/v1/generate", generate)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)  # its hung generation is not waited for
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"  # noqa: SLF001


@pytest.mark.parametrize("case", ["stuck", "working", "paused"])
def test_a_generation_on_an_engine_that_answers_but_does_no_work_is_given_up_as_the_engines_failure(case):
    """An engine whose front answers /v1/models while its engine does nothing (a hang in the engine core) held
    every call to the agent's deadline, graded as the agent's 0. The call is now given up, as the engine's
    failure (an OSError, retried: base/blame.py), once a whole `request_timeout_s` passes in which the server,
    not paused, counted no prefill or generated token. Still never for being long: an engine whose counters
    move (a long generation) is waited for, and so is a paused one (a weight update)."""
    import asyncio as aio

    async def go():
        server = _StuckVLLM(working=case == "working", paused=case == "paused")
        url = await server.start()
        client = VLLMClient([url], model="m", timeout=0.3, max_retries=0)
        call = aio.ensure_future(client.generate([1, 2, 3], SamplingParams(max_tokens=8)))
        try:
            done, _ = await aio.wait({call}, timeout=5)
            if case == "stuck":
                assert done, "a call on an engine that does no work was never given up"
                with pytest.raises(ConnectionError, match="processed no token"):
                    call.result()
            else:
                assert not done, call.result()  # still waited for after some 15 of its timeouts
            return server.generations
        finally:
            call.cancel()
            await aio.gather(call, return_exceptions=True)
            await client.close()
            await server.runner.cleanup()

    assert asyncio.run(go()) == 1  # given up, not sent again to a server that answers alike
