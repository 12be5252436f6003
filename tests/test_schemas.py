"""Schema round trips and strict decoding."""

from __future__ import annotations

import msgspec
import pytest

from rollway.actors.reward import assemble
from rollway.schemas import (
    SCHEMA_VERSION,
    AgentStep,
    DeadLetter,
    DecodeError,
    EpisodeFailure,
    EpisodeKey,
    InitRequest,
    Observation,
    PolicyVersion,
    RewardRequest,
    Trajectory,
    TurnRecord,
    check_version,
    decode,
    encode,
)
from rollway.topics import ALL_TOPICS, BY_NAME, get_topic

KEY = EpisodeKey(episode_id="r1-g00000-s0", group_id="r1-g00000", task_id="toy-000", attempt=1, sample_index=0)
REF = dict(episode=KEY)
RAW_REF = {"episode": msgspec.to_builtins(KEY)}


def turn(k: int, n_completion: int = 3, n_obs: int = 2) -> TurnRecord:
    return TurnRecord(turn=k, completion_ids=list(range(n_completion)), logprobs=[-0.5] * n_completion,
                      policy_version=k, finish_reason="stop", assistant_text="hi",
                      observations=[Observation(tool="bash", arguments={"command": "ls"}, content="a\nb")],
                      hints=["2 turns left"], observation_ids=[9] * n_obs)


SAMPLES = [
    InitRequest(**REF, issued_at=1.0, deadline=2.0),
    AgentStep(**REF, turn=0, sandbox={"kind": "local", "path": "/x"}, prompt_ids=[1, 2],
              messages=[{"role": "user", "content": "x"}], tools=[]),
    AgentStep(**REF, turn=2, sandbox={"kind": "local"}, start_offset=7, last=turn(1)),
    RewardRequest(**REF, sandbox={}, prompt_ids=[1], messages=[], turns=[turn(0)], stop_reason="finish"),
    Trajectory(**REF, token_ids=[1, 2], loss_mask=[0, 1], logprobs=[None, -0.1], turn_policy_versions=[0],
               turn_spans=[(1, 2)], reward=1.0, resolved=True, stop_reason="finish", num_turns=1, prompt_length=1),
    EpisodeFailure(**REF, stage="init", reason="boom"),
    PolicyVersion(version=3, checkpoint="/ckpt", metrics={"loss": 0.5}),
    DeadLetter(source_topic="agent-steps", partition=1, offset=5, key=b"k", value=b"\xff\x00", reason="x",
               stage="agent", at=1.0),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert decode(encode(msg), type(msg)) == msg


def test_every_topic_has_a_schema_and_episode_topics_are_keyed():
    names = {t.name for t in ALL_TOPICS}
    assert {"init-requests", "agent-steps", "reward-requests", "trajectories", "policy-versions",
            "dead-letters"} <= names
    for name in ("init-requests", "agent-steps", "reward-requests", "trajectories"):
        assert BY_NAME[name].keyed_by_episode
    with pytest.raises(KeyError, match="topics are"):
        get_topic("nope")


def test_wrong_type_is_a_decode_failure():
    raw = msgspec.msgpack.encode({**RAW_REF, "issued_at": "yesterday", "deadline": 2.0, "schema_version": SCHEMA_VERSION})
    with pytest.raises(DecodeError, match="issued_at"):
        decode(raw, InitRequest)


def test_missing_field_is_a_decode_failure():
    raw = msgspec.msgpack.encode({**RAW_REF, "issued_at": 1.0})
    with pytest.raises(DecodeError, match="deadline"):
        decode(raw, InitRequest)


def test_unknown_field_and_other_version_and_garbage_are_decode_failures():
    with pytest.raises(DecodeError, match="unknown field"):
        decode(msgspec.msgpack.encode({**RAW_REF, "issued_at": 1.0, "deadline": 2.0, "extra": 1}), InitRequest)
    with pytest.raises(DecodeError, match="schema_version 99"):
        decode(msgspec.msgpack.encode({**RAW_REF, "issued_at": 1.0, "deadline": 2.0, "schema_version": 99}), InitRequest)
    for garbage in (b"", b"\xc1\xc1", b"not msgpack at all", None):
        with pytest.raises(DecodeError):
            decode(garbage, AgentStep)


def test_identity_is_one_nested_value_passed_on_whole():
    """Every per-episode message holds the identity once, reads its fields through, and hands the same
    value to the episode's next message."""
    step = AgentStep(**REF, turn=0, sandbox={})
    assert (step.episode_id, step.group_id, step.task_id, step.attempt, step.sample_index) == \
        ("r1-g00000-s0", "r1-g00000", "toy-000", 1, 0)
    assert RewardRequest(episode=step.episode, sandbox={}, prompt_ids=[], messages=[], turns=[],
                         stop_reason="finish").episode is KEY
    assert msgspec.to_builtins(step)["episode"] == msgspec.to_builtins(KEY) and "episode_id" not in msgspec.to_builtins(step)
    with pytest.raises(AttributeError):
        KEY.attempt = 2  # frozen: a re-issued attempt is a new key


def test_message_of_the_previous_schema_version_is_refused_with_what_to_do():
    """A version-1 message (flat identity) fails on its version, not on a field, and says what to do."""
    v1 = msgspec.msgpack.encode({"episode_id": "e", "group_id": "g", "task_id": "t", "issued_at": 1.0,
                                 "deadline": 2.0, "schema_version": 1})
    with pytest.raises(DecodeError, match=r"schema_version 1; this rollway reads 2.*rollway version that wrote it"):
        decode(v1, InitRequest)
    with pytest.raises(DecodeError, match="trajectories.jsonl line 1 has schema_version 1"):
        check_version({"episode_id": "e", "schema_version": 1}, "trajectories.jsonl line 1")


def test_turn_message_carries_only_its_delta():
    """Bytes per turn message stay flat as the episode grows (event sourcing, not full history)."""
    sizes = [len(encode(AgentStep(**REF, turn=k + 1, sandbox={}, start_offset=0, last=turn(k)))) for k in range(50)]
    assert max(sizes) - min(sizes) < 8  # only the turn numbers' encoded widths differ


def test_assemble_builds_equal_length_token_arrays_with_mask_on_model_tokens():
    req = RewardRequest(**REF, sandbox={}, prompt_ids=[100, 101, 102], messages=[],
                        turns=[turn(0, 3, 2), turn(1, 4, 0)], stop_reason="finish")
    out = assemble(req)
    n = len(out["token_ids"])
    assert n == 3 + 3 + 2 + 4 and len(out["loss_mask"]) == n and len(out["logprobs"]) == n
    assert out["loss_mask"] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1]
    assert [lp is not None for lp in out["logprobs"]] == [bool(m) for m in out["loss_mask"]]
    assert out["turn_spans"] == [(3, 6), (8, 12)]


def test_assemble_rejects_misaligned_logprobs():
    bad = turn(0)
    bad.logprobs = [-1.0]
    with pytest.raises(ValueError, match="logprobs"):
        assemble(RewardRequest(**REF, sandbox={}, prompt_ids=[1], messages=[], turns=[bad], stop_reason="finish"))


def _with_hostile_value(value_bytes: bytes) -> bytes:
    """A well-formed AgentStep whose free-form sandbox dict holds `value_bytes` (raw MessagePack)."""
    marker = "HOSTILE-VALUE-MARKER"
    raw = msgspec.msgpack.encode({**RAW_REF, "turn": 1, "sandbox": {"x": marker}, "schema_version": SCHEMA_VERSION})
    encoded_marker = msgspec.msgpack.encode(marker)
    assert raw.count(encoded_marker) == 1
    return raw.replace(encoded_marker, value_bytes)


def test_deeply_nested_record_is_a_decode_failure_not_a_recursion_error():
    """A producer (or a corrupted log) can nest arrays 200,000 deep inside a free-form field; msgspec
    raises RecursionError there, which must become the DecodeError the runtime dead-letters."""
    nested = _with_hostile_value(b"\x91" * 200_000 + b"\xc0")
    with pytest.raises(DecodeError, match="AgentStep"):
        decode(nested, AgentStep)


@pytest.mark.parametrize("value_bytes", [
    b"\xdd\xff\xff\xff\xff",  # an array that claims 4 billion items
    b"\xdb\xff\xff\xff\xff" + b"a" * 10,  # a string that claims 4 GiB
    b"\xcf" + b"\xff" * 8,  # 2**64 - 1: fits MessagePack, not a Python-side bound
], ids=["huge-array", "huge-string", "max-uint64"])
def test_huge_lengths_and_numbers_decode_or_fail_cleanly(value_bytes):
    data = _with_hostile_value(value_bytes)
    try:
        decode(data, AgentStep)
    except DecodeError:
        pass  # the only failure allowed


def test_unencodable_message_raises_encode_error():
    """An integer above 2**64 (a hostile tool argument) cannot be MessagePack: one typed error."""
    from rollway.schemas.codec import EncodeError

    with pytest.raises(EncodeError, match="AgentStep"):
        encode(AgentStep(**REF, turn=1, sandbox={"view_range": [1, 2**65]}))
    nested: list = []
    for _ in range(100_000):
        nested = [nested]
    with pytest.raises(EncodeError):
        encode(AgentStep(**REF, turn=1, sandbox={"deep": nested}))
