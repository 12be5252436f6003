"""The model's own chat template as an append-only ChatFormat (token-in, token-out across turns)."""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict
from typing import Any

from rollway.policies.base import ChatFormat

_PROBE_USER = {"role": "user", "content": "x"}
_PROBE_REPLY = "\u2063rollway-probe\u2063"  # a string no template adds on its own
RENDERS_KEPT = 8
"""Renders kept by content (HFChatFormat.render)."""
PIECE_CHARS_KEPT = 32 * 2**20
"""Characters of tokenised text kept with their ids (HFChatFormat.encode_special), for all episodes of the
process: 64 episodes with 64k-token histories (about 256 KiB of text each) fit twice. At most about 32-128 MiB
of text (1-4 bytes a character) and 32 MiB of ids (4 bytes each, about 4 characters a token)."""


def _render_key(messages: list[dict[str, Any]], tools: list[dict[str, Any]], generation_prompt: bool) -> Any:
    """A hashable key for a render's inputs; None when a message holds something unhashable (the render is
    then not kept). Equal keys mean equal inputs: every field of every message, the tools as JSON."""
    try:
        key = (tuple(tuple(sorted(m.items())) for m in messages),
               json.dumps(tools, sort_keys=True) if tools else "", generation_prompt)
        hash(key)
    except TypeError:
        return None
    return key


def hermes_tools_note(tools: list[dict[str, Any]]) -> str:
    """Tool list in the Hermes format, for templates that do not render `tools` themselves."""
    listing = "\n".join(json.dumps(t.get("function", t), sort_keys=True) for t in tools)
    return ("# Tools\n\nYou may call the functions below. Their signatures are inside <tools></tools>:\n"
            f"<tools>\n{listing}\n</tools>\n\nTo call one, reply with a JSON object inside tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>')


class HFChatFormat(ChatFormat):
    """Renders with `tokenizer`'s chat template (or `chat_template`) and cuts renderings into turns.

    `continuation` is the suffix the template adds after the assistant's stop token for the new
    messages, so for an append-only template initial + completions + continuations == a full render.
    Templates that rewrite history (strip earlier reasoning, re-tokenize across turns) make `drift`
    report True; the accumulated ids stay what the model saw, which is what RL trains on."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.template = chat_template or tokenizer.chat_template
        if not self.template:
            raise ValueError("the tokenizer has no chat template: use a chat model or pass chat_template")
        self.native_tools = "tools" in self.template
        self._lock = threading.Lock()  # the caches below are shared by a gateway's threads
        self._renders: OrderedDict[Any, str] = OrderedDict()
        self._pieces: OrderedDict[str, array] = OrderedDict()
        self._pieces_chars = 0
        self._splitter: re.Pattern[str] | None = None  # whole-text tokenising unless the check below allows pieces
        self._split_at_added_tokens_if_exact()
        self._stop_text = self._probe_stop_text()
        self._stop_ids = tuple(self.encode_special(self._stop_text))
        self._header_ids = tuple(self._probe_header_ids())
        self._user_header_ids = self._probe_user_header_ids()

    # -- rendering ------------------------------------------------------------------------------

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], generation_prompt: bool) -> str:
        """The template's text for `messages` (tools inlined into the system message if needed). The last
        few renders are kept by content: a gateway call's drift check renders what its continuation just
        rendered."""
        key = _render_key(messages, tools, generation_prompt)
        if key is not None:
            with self._lock:
                text = self._renders.get(key)
            if text is not None:
                return text
        text = self._render(messages, tools, generation_prompt)
        if key is not None:
            with self._lock:
                self._renders[key] = text
                while len(self._renders) > RENDERS_KEPT:
                    self._renders.popitem(last=False)
        return text

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], generation_prompt: bool) -> str:
        if tools and not self.native_tools:
            messages = self._with_tools_in_system(messages, tools)
        return self.tokenizer.apply_chat_template(
            messages, tools=(tools or None) if self.native_tools else None, chat_template=self.template,
            add_generation_prompt=generation_prompt, tokenize=False)

    def _with_tools_in_system(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict]:
        note = hermes_tools_note(tools)
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": f"{messages[0]['content']}\n\n{note}"}, *messages[1:]]
        return [{"role": "system", "content": note}, *messages]

    def encode_special(self, text: str) -> list[int]:
        """Token ids of rendered template text (special-token strings become special tokens). The text
        between added tokens is tokenised piece by piece, each piece's ids kept (up to PIECE_CHARS_KEPT
        characters in all): a conversation re-rendered call after call tokenises only what is new.
        Exact where the tokenizer tokenises those pieces on their own (checked at start-up, else the
        whole text is tokenised each time)."""
        if self._splitter is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        ids: list[int] = []
        for i, piece in enumerate(self._splitter.split(text)):
            if i % 2:  # an added token's text
                ids.append(self._added[piece])
            elif piece:
                ids += self._piece_ids(piece)
        return ids

    def _piece_ids(self, piece: str) -> array:
        with self._lock:
            kept = self._pieces.get(piece)
            if kept is not None:
                self._pieces.move_to_end(piece)
                return kept
        kept = array("i", self.tokenizer.encode(piece, add_special_tokens=False))
        if len(piece) <= PIECE_CHARS_KEPT // 4:
            with self._lock:
                if piece not in self._pieces:
                    self._pieces[piece] = kept
                    self._pieces_chars += len(piece)
                while self._pieces_chars > PIECE_CHARS_KEPT:
                    self._pieces_chars -= len(self._pieces.popitem(last=False)[0])
        return kept

    def _split_at_added_tokens_if_exact(self) -> None:
        """Sets the pattern splitting text at the tokenizer's added tokens, when tokenising the pieces between
        them one by one gives exactly the whole text's ids: a fast tokenizer whose added tokens take no
        neighbouring whitespace and are matched before normalisation, checked on a rendered probe."""
        added = getattr(self.tokenizer, "added_tokens_decoder", None)
        if not getattr(self.tokenizer, "is_fast", False) or not added:
            return
        if any(getattr(t, flag, True) for t in added.values() for flag in ("lstrip", "rstrip", "single_word", "normalized")):
            return
        self._added = {t.content: i for i, t in added.items() if t.content}
        self._splitter = re.compile("(" + "|".join(re.escape(c) for c in sorted(self._added, key=len, reverse=True))
                                    + ")")  # tried on the probe through encode_special itself
        probe = self._render([{"role": "system", "content": " a  b\n"}, _PROBE_USER,
                              {"role": "assistant", "content": _PROBE_REPLY + " x\n\n"}, {"role": "user", "content": "\ty"}],
                             [], True)
        if self.encode_special(probe) != self.tokenizer.encode(probe, add_special_tokens=False):
            self._splitter = None

    def _probe_stop_text(self) -> str:
        # The text right after an assistant reply up to its first special token is the turn end.
        text = self.render([_PROBE_USER, {"role": "assistant", "content": _PROBE_REPLY}], [], False)
        after = text[text.index(_PROBE_REPLY) + len(_PROBE_REPLY):]
        for token in sorted(self.tokenizer.all_special_tokens, key=len, reverse=True):
            if token and after.lstrip().startswith(token):
                return token
        if self.tokenizer.eos_token:
            return self.tokenizer.eos_token
        raise ValueError("cannot tell which token ends an assistant turn in this chat template")

    def _probe_header_ids(self) -> list[int]:
        bare = self.render([_PROBE_USER], [], False)
        prompt = self.render([_PROBE_USER], [], True)
        if not prompt.startswith(bare):
            raise ValueError("the chat template's generation prompt is not a suffix of the conversation")
        return self.encode_special(prompt[len(bare):])

    def _probe_user_header_ids(self) -> tuple[int, ...] | None:
        # A user turn opens with the text from the last special token before its content.
        text = self.render([{"role": "user", "content": _PROBE_REPLY}], [], False)
        before = text[: text.index(_PROBE_REPLY)]
        at = max(before.rfind(t) for t in self.tokenizer.all_special_tokens if t)
        return tuple(self.encode_special(before[at:])) if at >= 0 else None

    def _end_of_last_turn(self, text: str) -> int:
        """Offset just after the last assistant turn's stop token in `text`."""
        at = text.rfind(self._stop_text)
        if at < 0:
            raise ValueError(f"no {self._stop_text!r} in the rendered history: it must end with an assistant turn")
        return at + len(self._stop_text)

    # -- ChatFormat ------------------------------------------------------------------------------

    def initial(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        return self.encode_special(self.render(messages, tools, True))

    def continuation(self, history: list[dict[str, Any]], new: list[dict[str, Any]],
                     tools: list[dict[str, Any]]) -> list[int]:
        """Ids after the model's stop token (which must end its completion: if it hit max_tokens, the
        caller appends `stop_token_ids[0]` first). For a template that rewrites history the suffix is
        taken from a neutral one-turn context instead (and `drift` reports the mismatch)."""
        if not history or history[-1]["role"] != "assistant":
            raise ValueError("continuation() expects history to end with the assistant's completed turn")
        prefix = self.render(history, tools, False)
        full = self.render([*history, *new], tools, True)
        cut = self._end_of_last_turn(prefix)
        if full[:cut] != prefix[:cut]:
            probe = [_PROBE_USER, {"role": "assistant", "content": _PROBE_REPLY}]
            prefix = self.render(probe, [], False)
            full = self.render([*probe, *new], [], True)
            cut = self._end_of_last_turn(prefix)
        return self.encode_special(full[cut:])

    def drift(self, history: list[dict[str, Any]], tools: list[dict[str, Any]], token_ids: list[int]) -> bool:
        """True when a from-scratch render of `history` differs from the accumulated `token_ids`
        (which end with a generation prompt, or with the stop token if history ends with the assistant)."""
        ends_with_reply = bool(history) and history[-1]["role"] == "assistant"
        text = self.render(history, tools, not ends_with_reply)
        if ends_with_reply:
            text = text[: self._end_of_last_turn(text)]
        return self.encode_special(text) != list(token_ids)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)

    @property
    def assistant_header_ids(self) -> tuple[int, ...]:
        return self._header_ids

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    @property
    def user_header_ids(self) -> tuple[int, ...] | None:
        return self._user_header_ids
