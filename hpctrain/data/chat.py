"""Chat and instruction data for ``hpctrain-prepare --format chat|instruction``.

**Inputs** are JSON Lines (``.jsonl``/``.json``/``.ndjson``, optionally
``.gz``/``.zst``), one conversation per line:

- ``--format chat``: ``{"messages": [{"role": "system", "content": "..."},
  {"role": "user", ...}, {"role": "assistant", ...}, ...]}`` (the key is
  ``--messages-key``); every message an object with a string ``role`` and a
  string ``content`` (other keys are handed to the template as they are;
  tool calls are not supported);
- ``--format instruction``: ``{"prompt": "...", "response": "..."}`` (keys
  ``--prompt-key``, ``--response-key``), and an optional system message
  under ``--system-key`` (default ``system``; absent or empty: none), made
  into the conversation ``[system], user: prompt, assistant: response``.

**Rendering.** Each conversation is rendered by the tokenizer's own chat
template with transformers' ``apply_chat_template`` (the tokenizer directory
is loaded with ``AutoTokenizer.from_pretrained(dir, local_files_only=True)``;
``--chat-template FILE`` gives a Jinja template instead of the tokenizer's),
and the text is tokenised as ``apply_chat_template(..., tokenize=True)``
tokenises it (no special tokens added: the template writes BOS and the
end-of-turn tokens itself). The document written is exactly those ids: no
BOS or EOS is added, so a shard's conversation equals transformers' token
for token (``tests/unit/data/test_chat.py``).

**The loss mask** (one byte per token, ``hpctrain.data.indexed``): 1 where
the token is trained on as a target (predicted from the tokens before it),
0 elsewhere. ``--train-on``:

- ``assistant`` (default): the tokens of every assistant turn, as the
  template renders the turn after its generation prompt: the content and the
  template's end-of-turn tokens (so the model learns to stop);
- ``last-assistant``: the final assistant turn only;
- ``all``: every token.

A conversation's first token is never trained on (nothing before it in the
conversation predicts it; packing puts another conversation there). An
assistant turn's tokens are found by rendering the conversation up to the
turn with the generation prompt (where the turn starts) and through the turn
(where it ends): the character span between the two, mapped to the tokens
whose first character lies in it. A template with ``{% generation %}``
blocks (transformers' own assistant-mask markers) is asked for its mask
directly with ``--train-on assistant`` (``return_assistant_tokens_mask``);
for other templates, one whose rendering of a conversation's beginning is not
the beginning of its rendering of the whole (templates that rewrite earlier
turns, e.g. strip reasoning) is refused with one line: give
``--chat-template`` a template with generation blocks.

**Refused** (one line naming the input's line and the fix): a line without
the key, messages that are not a list of role/content objects, an empty
conversation, a conversation the template cannot render; with ``--train-on
assistant`` or ``last-assistant``, conversations without an assistant turn
are counted over the whole run and refused together (they would train on
nothing; the line gives the count and the first one's place).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from hpctrain.data.inputs import PARQUET, DocumentReader, InputError
from hpctrain.data.tokenize import HUGGINGFACE, TokenizerError, TokenizerSpec, _limit_threads

CHAT, INSTRUCTION = "chat", "instruction"
FORMATS = ("text", CHAT, INSTRUCTION)
ASSISTANT, LAST_ASSISTANT, ALL = "assistant", "last-assistant", "all"
TRAIN_ON = (ASSISTANT, LAST_ASSISTANT, ALL)
MASK_DTYPE = np.uint8
INSTALL = "pip install 'hpctrain[hf]'"


class ConversationError(Exception):
    """A conversation the template cannot render or mask: the reason (the caller names the input line)."""


@dataclass(frozen=True)
class ChatSpec:
    """How conversations are read and rendered (plain data: sent to worker processes, recorded in the manifest)."""

    format: str
    directory: str
    """The tokenizer directory transformers loads."""
    template: Optional[str]
    """The Jinja template of ``--chat-template`` (None: the tokenizer's own)."""
    template_name: str
    """Where the template came from: the file, or ``tokenizer``."""
    train_on: str
    seq_len: int
    messages_key: str = "messages"
    prompt_key: str = "prompt"
    response_key: str = "response"
    system_key: str = "system"

    def describe(self) -> dict:
        out = {"format": self.format, "train_on": self.train_on, "chat_template": self.template_name,
               "seq_len": self.seq_len}
        if self.format == CHAT:
            out["messages_key"] = self.messages_key
        else:
            out.update(prompt_key=self.prompt_key, response_key=self.response_key, system_key=self.system_key)
        return out


def _transformers(why: str):
    try:
        import transformers  # optional: the hf extra
    except ImportError:
        raise TokenizerError(f"{why} needs the transformers package (its apply_chat_template), which is not "
                             f"installed; {INSTALL}") from None
    return transformers


def load_tokenizer(directory: str, arg: str):
    """transformers' tokenizer of ``directory`` (local files only); TokenizerError with one line."""
    _limit_threads()
    transformers = _transformers(f"--tokenizer {arg} with a chat template")
    try:
        return transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for an unloadable directory
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TokenizerError(f"--tokenizer {arg}: transformers cannot load the tokenizer in {directory} ({reason}); "
                             f"give a directory saved by transformers (tokenizer.json and tokenizer_config.json)"
                             ) from None


def resolve_chat(spec: TokenizerSpec, arg: str, fmt: str, template_file: Optional[str], train_on: str,
                 seq_len: int, messages_key: str = "messages", prompt_key: str = "prompt",
                 response_key: str = "response", system_key: str = "system") -> ChatSpec:
    """The chat spec for these options (loads the tokenizer once, rank 0); TokenizerError with one line."""
    if spec.kind != HUGGINGFACE or spec.path is None:
        raise TokenizerError(f"--format {fmt} renders conversations with a Hugging Face chat template; give "
                             f"--tokenizer a model directory holding tokenizer.json and tokenizer_config.json "
                             f"(not {arg})")
    directory = os.path.dirname(spec.path)
    tok = load_tokenizer(directory, arg)
    template = None
    name = "tokenizer"
    if template_file is not None:
        path = os.path.abspath(os.path.expanduser(template_file))
        try:
            with open(path, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"--chat-template {template_file} cannot be read ({getattr(e, 'strerror', None) or e})"
                                 f"; give a Jinja chat template file") from None
        if not template.strip():
            raise TokenizerError(f"--chat-template {template_file} is empty; give a Jinja chat template file")
        name = path
    elif not getattr(tok, "chat_template", None):
        raise TokenizerError(f"--tokenizer {arg} has no chat template (no chat_template in its tokenizer_config.json, "
                             f"no chat_template.jinja beside it); pass --chat-template FILE (a Jinja template), or "
                             f"use the tokenizer of the model's instruct/chat version")
    return ChatSpec(fmt, directory, template, name, train_on, seq_len, messages_key, prompt_key, response_key,
                    system_key)


# -- reading conversations ---------------------------------------------------------------

Conversation = List[dict]


def conversation_size(messages: Conversation) -> int:
    """Characters of a conversation's contents (what a batch of conversations is sized by)."""
    return sum(len(m.get("content") or "") for m in messages)


class ConversationReader(DocumentReader):
    """The conversations of one JSON Lines file: ``(messages, line, False)``, like ``DocumentReader``'s documents."""

    def __init__(self, inp, chat: ChatSpec):
        super().__init__(inp, "file", chat.messages_key, as_bytes=False)
        self.chat = chat

    def __iter__(self) -> Iterator[Tuple[Any, int, bool]]:
        if self.inp.format == PARQUET:
            raise InputError(f"input {self.inp.path} is Parquet; --format {self.chat.format} reads JSON Lines "
                             f"(one conversation per line): convert it, e.g. with pandas' to_json(lines=True)")
        return super().__iter__()

    def _whole(self, stream):  # a file named otherwise (.txt): read as JSON Lines all the same
        return self._jsonl(stream)

    def _jsonl(self, stream) -> Iterator[Tuple[Any, int, bool]]:
        path = self.inp.path
        for number, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise InputError(f"input {path} line {number} is not JSON ({e}); --format {self.chat.format} needs "
                                 f"one JSON object per line") from None
            if not isinstance(obj, dict):
                raise InputError(f"input {path} line {number} is a JSON {type(obj).__name__}, not an object; "
                                 f"--format {self.chat.format} needs one object per line")
            messages = self._messages(obj, number)
            yield messages, number, False

    def _missing(self, obj: dict, number: int, key: str, flag: str) -> InputError:
        keys = ", ".join(map(str, list(obj)[:8])) or "none"
        return InputError(f"input {self.inp.path} line {number} has no key {key!r} (its keys: {keys}); pass "
                          f"{flag} KEY, or fix the line")

    def _messages(self, obj: dict, number: int) -> Conversation:
        path, chat = self.inp.path, self.chat
        if chat.format == INSTRUCTION:
            out: Conversation = []
            for key, flag in ((chat.prompt_key, "--prompt-key"), (chat.response_key, "--response-key")):
                if key not in obj:
                    raise self._missing(obj, number, key, flag)
                if not isinstance(obj[key], str):
                    raise InputError(f"input {path} line {number}: {key!r} holds a JSON {type(obj[key]).__name__}, "
                                     f"not a string; pass {flag} with the key of the text")
            system = obj.get(chat.system_key)
            if system is not None and not isinstance(system, str):
                raise InputError(f"input {path} line {number}: {chat.system_key!r} holds a JSON "
                                 f"{type(system).__name__}, not a string; pass --system-key with the key of the "
                                 f"system message")
            if system:
                out.append({"role": "system", "content": system})
            out.append({"role": "user", "content": obj[chat.prompt_key]})
            out.append({"role": "assistant", "content": obj[chat.response_key]})
            return out
        key = chat.messages_key
        if key not in obj:
            raise self._missing(obj, number, key, "--messages-key")
        messages = obj[key]
        if not isinstance(messages, list) or not messages:
            what = "an empty list" if isinstance(messages, list) else f"a JSON {type(messages).__name__}"
            raise InputError(f"input {path} line {number}: {key!r} holds {what}, not a list of messages; each line "
                             f"needs {{\"{key}\": [{{\"role\": ..., \"content\": ...}}, ...]}}")
        for i, m in enumerate(messages, 1):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                shown = json.dumps(m)[:80]
                raise InputError(f"input {path} line {number}: message {i} ({shown}) is not an object with a string "
                                 f"role and a string content; fix the line (tool calls are not supported)")
        return messages


# -- rendering and masking ------------------------------------------------------------------

def _render(tok, messages: Sequence[dict], template: Optional[str], generation_prompt: bool = False) -> str:
    try:
        text = tok.apply_chat_template(list(messages), chat_template=template, tokenize=False,
                                       add_generation_prompt=generation_prompt)
    except Exception as e:  # noqa: BLE001 - a template raises what its Jinja code raises
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConversationError(f"the chat template cannot render this conversation ({type(e).__name__}: {reason}); "
                                f"fix the conversation or give --chat-template FILE") from None
    if not isinstance(text, str):
        raise ConversationError("the chat template did not render text; give --chat-template FILE")
    return text


_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


def _has_generation_blocks(template: str) -> bool:
    """Whether ``template`` marks assistant turns with transformers' ``{% generation %}`` blocks."""
    return bool(_GENERATION.search(template))


def assistant_spans(tok, messages: Sequence[dict], text: str, template: Optional[str], which: Sequence[int]
                    ) -> List[Tuple[int, int]]:
    """Character spans of the assistant turns ``which`` in ``text`` (the whole rendering): each from the end of
    the rendering up to the turn with the generation prompt to the end of the rendering through the turn."""
    spans = []
    for i in which:
        before = _render(tok, messages[:i], template, generation_prompt=True)
        through = _render(tok, messages[:i + 1], template)
        if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
            raise ConversationError(
                f"the chat template renders the conversation up to message {i + 1} differently from the start of the "
                f"whole (it rewrites earlier turns), so the assistant tokens cannot be found; give --chat-template "
                f"FILE with the turns inside {{% generation %}} ... {{% endgeneration %}} blocks")
        spans.append((len(before), len(through)))
    return spans


def render(tok, messages: Sequence[dict], template: Optional[str] = None, train_on: str = ASSISTANT
           ) -> Tuple[List[int], np.ndarray, int]:
    """(token ids, loss mask (uint8, one per token), assistant turns) of one conversation (module docstring)."""
    text = _render(tok, messages, template)
    turns = [i for i, m in enumerate(messages) if m.get("role") == ASSISTANT]
    source = template if template is not None else tok.get_chat_template()
    if train_on == ASSISTANT and _has_generation_blocks(source):
        out = tok.apply_chat_template(list(messages), chat_template=template, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        ids = list(out["input_ids"])
        mask = np.asarray(out["assistant_masks"], dtype=MASK_DTYPE)
    else:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        if train_on == ALL:
            mask = np.ones(len(ids), dtype=MASK_DTYPE)
        else:
            which = turns[-1:] if train_on == LAST_ASSISTANT else turns
            starts = np.asarray([a for a, _ in enc["offset_mapping"]], dtype=np.int64)
            mask = np.zeros(len(ids), dtype=MASK_DTYPE)
            for a, b in assistant_spans(tok, messages, text, template, which):
                mask[(starts >= a) & (starts < b)] = 1
    if len(mask):
        mask[0] = 0
    return ids, mask, len(turns)


class ChatEncoder:
    """Renders batches of conversations (``Encoder``'s counterpart): ids, masks, and which lack an assistant turn."""

    def __init__(self, spec: TokenizerSpec, chat: ChatSpec):
        self.spec, self.chat = spec, chat
        self.dtype = np.dtype(spec.dtype)
        self.tok = load_tokenizer(chat.directory, chat.directory)

    def encode(self, conversations: Sequence[Conversation], open_ended: Optional[Sequence[bool]] = None
               ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(tokens back to back, lengths, masks back to back, no assistant turn (bool per conversation))."""
        ids, masks, lengths, lacking = [], [], [], []
        for messages in conversations:
            one, mask, turns = render(self.tok, messages, self.chat.template, self.chat.train_on)
            ids.append(np.asarray(one, dtype=self.dtype))
            masks.append(mask)
            lengths.append(len(one))
            lacking.append(turns == 0)
        if not ids:
            return (np.zeros(0, self.dtype), np.zeros(0, np.int64), np.zeros(0, MASK_DTYPE), np.zeros(0, bool))
        return (np.concatenate(ids), np.asarray(lengths, dtype=np.int64), np.concatenate(masks),
                np.asarray(lacking, dtype=bool))
