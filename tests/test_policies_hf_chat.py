"""HFChatFormat with SmolLM2's own template: append-only across tool turns, drift on rewriting templates."""

from __future__ import annotations

import pytest

from rollway.policies.hf_chat import HFChatFormat

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command",
                                           "parameters": {"type": "object",
                                                          "properties": {"cmd": {"type": "string"}}}}}]
REPLIES = ['<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>',
           '<tool_call>\n{"name": "bash", "arguments": {"cmd": "cat a.py"}}\n</tool_call>',
           "The bug is in a.py line 3."]
TOOL_OUTPUTS = ["a.py\nb.py", "def f():\n    return 1 / 0"]

# Keeps only the latest assistant reply (as reasoning-stripping templates do): not append-only.
DROPPING_TEMPLATE = (
    "{% set last = namespace(i=-1) %}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% set last.i = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] != 'assistant' or loop.index0 == last.i %}{{ m['content'] }}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    from rollway.policies.model_loading import load_tokenizer

    return load_tokenizer()


def play(chat: HFChatFormat) -> tuple[list[int], list[dict], bool]:
    """A 3-turn tool episode built the way the agent builds it; returns ids, history, any drift."""
    history = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "Fix the bug."}]
    ids, drifted = chat.initial(history, TOOLS), False
    for turn, reply in enumerate(REPLIES):
        ids += chat.encode(reply) + list(chat.stop_token_ids)  # what the model samples
        history.append({"role": "assistant", "content": reply})
        drifted |= chat.drift(history, TOOLS, ids)
        if turn < len(TOOL_OUTPUTS):
            new = [{"role": "tool", "content": TOOL_OUTPUTS[turn]}]
            ids += chat.continuation(history, new, TOOLS)
            history += new
            drifted |= chat.drift(history, TOOLS, ids)
    return ids, history, drifted


def test_smollm2_template_is_append_only_over_tool_turns(tokenizer):
    chat = HFChatFormat(tokenizer)
    ids, history, drifted = play(chat)
    full = chat.encode_special(chat.render(history, TOOLS, False))
    assert ids == full[: len(ids)] and chat.decode(full[len(ids):]).strip() == ""  # only ChatML's final "\n"
    assert not drifted


def test_continuation_starts_after_stop_token_and_ends_with_generation_prompt(tokenizer):
    chat = HFChatFormat(tokenizer)
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    ids = chat.continuation(history, [{"role": "user", "content": "again"}], [])
    assert tokenizer.decode(ids) == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    assert tuple(ids[-len(chat.assistant_header_ids):]) == chat.assistant_header_ids
    assert chat.stop_token_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert tokenizer.decode(chat.user_header_ids) == "<|im_start|>user\n"
    prompt = chat.initial([*history, {"role": "user", "content": "again"}], []) + chat.encode("ok") + [2]
    assert chat.turns_since_user(prompt + chat.continuation([*history, {"role": "assistant", "content": "ok"}],
                                                            [{"role": "tool", "content": "1"}], [])) == 1


def test_tools_go_into_the_system_message_in_hermes_format(tokenizer):
    chat = HFChatFormat(tokenizer)
    assert not chat.native_tools  # SmolLM2's template ignores `tools`
    text = tokenizer.decode(chat.initial([{"role": "user", "content": "go"}], TOOLS))
    assert text.startswith("<|im_start|>system\n# Tools")
    assert '"name": "bash"' in text and "<tool_call>" in text and text.endswith("<|im_start|>assistant\n")


def test_drift_fires_on_a_template_that_drops_earlier_replies(tokenizer):
    chat = HFChatFormat(tokenizer, chat_template=DROPPING_TEMPLATE)
    ids, history, drifted = play(chat)
    assert drifted
    assert chat.drift(history, TOOLS, ids)  # the whole conversation no longer re-renders to `ids`


def test_encode_keeps_special_token_text_as_plain_text(tokenizer):
    chat = HFChatFormat(tokenizer)
    ids = chat.encode("a<|im_end|>b")
    assert chat.stop_token_ids[0] not in ids and chat.decode(ids) == "a<|im_end|>b"


def test_piecewise_tokenising_gives_the_whole_texts_ids(tokenizer):
    """encode_special tokenises the text between added tokens piece by piece and keeps each piece's ids;
    on renders with every kind of content (special-token text inside a tool output, whitespace runs at the
    edges, unicode, code, a long output) the ids equal the tokenizer's on the whole text, called twice (the
    second from the kept pieces). Seen failing with the pieces tokenised after stripping their edges."""
    import random

    chat = HFChatFormat(tokenizer)
    assert chat._splitter is not None  # SmolLM2's tokenizer qualifies; the check at start-up said so
    rng = random.Random(7)
    bits = ["  ", "\n\n", "\t", "<|im_end|>", "<|im_start|>assistant\n", "héllo wörld ", "日本語 ", "def f(x):\n    ",
            "return x ** 2\n", "```py\n", "<tool_call>", " 3.14159", "\u2063", "\r\n", "ls -la /tmp | grep -v foo", "x" * 300]
    for _ in range(25):
        history = [{"role": "system", "content": "".join(rng.choices(bits, k=5))}]
        for _ in range(rng.randint(1, 6)):
            history += [{"role": "user", "content": "".join(rng.choices(bits, k=rng.randint(0, 12)))},
                        {"role": "assistant", "content": "".join(rng.choices(bits, k=rng.randint(1, 6)))}]
        text = chat.render(history, TOOLS if rng.random() < 0.5 else [], True)
        whole = tokenizer.encode(text, add_special_tokens=False)
        assert chat.encode_special(text) == whole
        assert chat.encode_special(text) == whole  # from the kept pieces


def test_a_tokenizer_whose_pieces_do_not_tokenise_alone_is_tokenised_whole(tokenizer):
    """An added token that takes the whitespace beside it (rstrip) makes piecewise tokenising inexact:
    the format falls back to the whole text, and its ids are still the tokenizer's."""
    import copy

    from tokenizers import AddedToken

    changed = copy.deepcopy(tokenizer)
    changed.add_special_tokens({"additional_special_tokens": [AddedToken("<|tool|>", rstrip=True, special=True)]})
    chat = HFChatFormat(changed)
    assert chat._splitter is None
    text = chat.render([{"role": "user", "content": "run <|tool|>   ls"}], [], True)
    assert chat.encode_special(text) == changed.encode(text, add_special_tokens=False)


def test_a_render_is_kept_by_content_not_by_identity(tokenizer):
    """The drift check renders what the continuation just rendered: equal messages (new dicts, same
    content) give the kept text; a changed field renders anew."""
    chat = HFChatFormat(tokenizer)
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    first = chat.render(history, TOOLS, True)
    assert chat.render([dict(m) for m in history], TOOLS, True) is first
    assert chat.render([history[0], {"role": "assistant", "content": "c"}], TOOLS, True) != first
    assert chat.render(history, [], True) != first
