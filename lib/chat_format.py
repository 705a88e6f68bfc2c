"""OpenAI chat messages <-> the model's tokens and text, through the tokenizer's own chat template.

    render_ids(tokenizer, messages, tools)          # prompt tokens of a conversation, generation prompt added
    continuation_ids(tokenizer, history, messages, tools)   # only the tokens that follow `history`'s last assistant turn
    parse_tool_calls(text)                          # Qwen2.5 / Hermes `<tool_call>{json}</tool_call>` -> OpenAI tool_calls
    template_renders_tools(tokenizer)               # False: pass tools_as_text=True to the two renderers above
    token_bytes_reader(tokenizer)(token_id)         # (text, UTF-8 bytes) of a sampled token, as OpenAI's logprobs show it

Messages arrive in OpenAI's shape (content as a string, a list of text parts or null; assistant
`tool_calls` with `arguments` as a JSON string) and are rendered in the shape HF chat templates
expect (`arguments` as a dict). Anything that cannot be rendered (arguments nested deeper than
MAX_JSON_DEPTH, a lone surrogate) raises `ChatFormatError`, whose message names the field; the proxy
answers it with a 400.

Why `continuation_ids` cuts text instead of re-tokenizing the conversation: an earlier assistant
turn must stay the tokens the model sampled (re-encoding its text can give other ids, and chat
templates often re-render a turn, e.g. tool calls as reformatted JSON). Only what follows that turn
is new: the template's rendering of `messages` must begin with its rendering of `history` up to the
end-of-turn token that closes the last assistant turn; the rest of the text is tokenized on its
own. Special tokens split BPE, so that text gets the ids it has inside the whole rendering.

Templates without a tools section (SmolLM2's ChatML renders only `content`) get the tools as text
(`tools_as_text`), in the layout Qwen2.5 and lib.tiny_model.TOOLS_CHAT_TEMPLATE use: the tool list
and how to call them in the system turn, calls as `<tool_call>` blocks in the assistant's text,
results as a user turn of `<tool_response>` blocks. It is a rewrite of the messages before the
template renders them, so the prefix rule above holds for it as for any template.
"""
import json
import uuid

from lib.http_body import lone_surrogate


class ChatFormatError(ValueError):
    """A request the chat template cannot render; the message names the field."""


class PromptTooLong(ChatFormatError):
    """Messages longer than to_template_messages' `max_chars`; `chars` is how long they are (at least)."""

    def __init__(self, chars: int):
        super().__init__(f"the messages come to more than {chars} characters")
        self.chars = chars


ROLES = ("system", "developer", "user", "assistant", "tool")
# Tool-call arguments nest at most this deep, the model's and the agent's alike: past it they are not
# a tool call (parse_tool_calls) or a 400 (to_template_messages), not a stack overflow in a JSON
# encoder or a template.
MAX_JSON_DEPTH = 64


def _text_of(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ChatFormatError(f"{where}.content[{i}]: only text parts are supported, got type {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise ChatFormatError(f"{where}.content must be a string, a list of text parts or null, got {type(content).__name__}")


def _arguments(raw, where: str):
    """A tool call's arguments as a template renders them: the decoded JSON object when it is one."""
    if not isinstance(raw, (str, dict)):
        raise ChatFormatError(f"{where}.function.arguments must be a JSON string, got {type(raw).__name__}")
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
        # (counting brackets first spares the walk, ~2x json.loads's time, for all but deep-looking text)
        too_deep = ((not isinstance(raw, str) or raw.count("[") + raw.count("{") > MAX_JSON_DEPTH)
                    and nesting(value) > MAX_JSON_DEPTH)
    except RecursionError:  # json.loads gives up near 1000 levels
        too_deep = True
    except ValueError:
        return raw  # the model wrote something that is not JSON; render it as it is
    if too_deep:  # the template's JSON encoder (and ours) would overflow the stack on it
        raise ChatFormatError(f"{where}.function.arguments nests lists and objects deeper than {MAX_JSON_DEPTH} "
                              "levels (the proxy never gives out such a tool call)")
    return value if isinstance(value, dict) else raw


def _string_or_none(value):
    return value if isinstance(value, str) else None  # an id the template may render: only ever a string


def nesting(value) -> int:
    """How deeply lists and dicts nest in a JSON value (0 for a scalar), found without recursion."""
    depth, level = 0, [value]
    while level := [x for x in level if isinstance(x, (list, dict))]:
        depth += 1
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x)]
    return depth


LONE_SURROGATE = ("holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which is not text; send characters "
                  "outside the Basic Multilingual Plane as surrogate pairs or as UTF-8")


def to_template_messages(messages, max_chars: int | None = None) -> list[dict]:
    """OpenAI request messages -> the dicts HF chat templates render. Raises ChatFormatError, or
    PromptTooLong once the contents and tool-call arguments (as sent) come to more than `max_chars`,
    before the arguments past it are decoded (20 MB of them take seconds)."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list")
    out, chars = [], 0
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatFormatError(f"{where} must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise ChatFormatError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
        msg = {"role": "system" if role == "developer" else role, "content": _text_of(m.get("content"), where)}
        chars += len(msg["content"])
        if role == "assistant" and m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise ChatFormatError(f"{where}.tool_calls must be a list")
            calls = []
            for j, call in enumerate(m["tool_calls"]):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ChatFormatError(f"{where}.tool_calls[{j}] needs function.name")
                chars += len(fn["arguments"]) if isinstance(fn.get("arguments"), str) else 0
                if max_chars is not None and chars > max_chars:
                    raise PromptTooLong(chars)
                calls.append({"id": _string_or_none(call.get("id")), "type": "function",
                              "function": {"name": fn["name"],
                                           "arguments": _arguments(fn.get("arguments", "{}"), f"{where}.tool_calls[{j}]")}})
            msg["tool_calls"] = calls
        if role == "tool":
            msg["tool_call_id"] = _string_or_none(m.get("tool_call_id"))
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if any(map(lone_surrogate, (msg["content"], msg.get("name", ""), msg.get("tool_call_id") or "",
                                    msg.get("tool_calls", "")))):
            raise ChatFormatError(f"{where} {LONE_SURROGATE}")
        if max_chars is not None and chars > max_chars:
            raise PromptTooLong(chars)
        out.append(msg)
    return out


def message_key(msg: dict) -> tuple[str, str, str, str | None]:
    """What two template messages must share to be the same turn: everything the template may
    render (tool call ids excepted: they are the proxy's labels, and SDKs keep them anyway), as
    (role, content, tool calls as JSON or "", name). A tuple: built without serializing the
    content, which a long conversation sends back on every request."""
    calls = msg.get("tool_calls")
    calls = json.dumps([{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls],
                       sort_keys=True, ensure_ascii=False) if calls else ""
    return msg["role"], msg["content"], calls, msg.get("name")


def render_text(tokenizer, messages: list[dict], tools=None, *, add_generation_prompt: bool,
                chat_template: str | None = None, tools_as_text: bool = False) -> str:
    if tools_as_text:
        messages, tools = with_tools_as_text(messages, tools), None
    try:
        return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, chat_template=chat_template)
    except Exception as e:  # jinja's TemplateError (e.g. "roles must alternate") and friends: the request's fault
        raise ChatFormatError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from None


# Texts longer than this are rendered and tokenized off the event loop (lib/openai_proxy.py), where
# the tokenizer must let other threads run; a shorter one costs less than a thread hop.
LONG_TEXT_CHARS = 1 << 16


def _rust_encoder(tokenizer):
    """A fast tokenizer's Rust encoder when it is set up as `__call__` would set it (special tokens
    whole), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False)):
        return backend
    return None


def encode(tokenizer, text: str) -> list[int]:
    """`tokenizer(text, add_special_tokens=False)["input_ids"]`, by the Rust encoder directly where
    there is one: the same ids without the BatchEncoding around them, ~3x cheaper on a short text,
    which the proxy encodes on the event loop (tests/test_openai_proxy.py compares the two)."""
    backend = _rust_encoder(tokenizer)
    if backend is None:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(text) > LONG_TEXT_CHARS:  # encode_batch lets go of the GIL (encode holds it), as __call__ does
        return backend.encode_batch([text], add_special_tokens=False)[0].ids
    return backend.encode(text, add_special_tokens=False).ids


def encode_batch(tokenizer, texts: list[str]) -> list[list[int]]:
    """`encode` of many texts in one call (in parallel threads where the encoder is Rust's): what
    a warm start's thousands of demonstration pieces are tokenized with."""
    if not texts:
        return []
    backend = _rust_encoder(tokenizer)
    if backend is None:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [enc.ids for enc in backend.encode_batch(texts, add_special_tokens=False)]


def render_ids(tokenizer, messages: list[dict], tools=None, chat_template: str | None = None, *,
               tools_as_text: bool = False) -> list[int]:
    """The prompt of a conversation: the template's text with the generation prompt, tokenized."""
    return encode(tokenizer, render_text(tokenizer, messages, tools, add_generation_prompt=True,
                                         chat_template=chat_template, tools_as_text=tools_as_text))


def end_of_turn_token(tokenizer, chat_template: str | None = None) -> tuple[str, int]:
    """(text, id) of the special token the template closes an assistant turn with (ChatML's
    <|im_end|>, Llama 3's <|eot_id|>): the first special token after an assistant turn's content."""
    probe = "PROBE-7f3a"
    text = render_text(tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}],
                       add_generation_prompt=False, chat_template=chat_template)
    after = text[text.rfind(probe) + len(probe):] if probe in text else ""
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    for token in encode(tokenizer, after):
        if token in special:
            return tokenizer.convert_ids_to_tokens(token), token
    raise ValueError("the chat template closes an assistant turn with no special token; the proxy needs one "
                     "(ChatML's <|im_end|>) to tell where a sampled turn ends")


def closing_ids(tokenizer, output_ids: list[int], stop_token_ids) -> list[int]:
    """What a token loop appends (loss mask 0) after a sampled turn before anything else follows it:
    the chat template's end of turn when the turn ended at another of `stop_token_ids` (Qwen2.5 stops
    on <|endoftext|> too, its template closes turns with <|im_end|>), so that later turns condition
    on what the template renders; else nothing (the turn ended at the end of turn, or did not end at
    a stop id: the caller's own rule for a cut)."""
    if not output_ids or output_ids[-1] not in stop_token_ids:
        return []
    from lib.warm_start import end_of_turn_ids  # what the demonstrations close turns with; templated only here

    end = end_of_turn_ids(tokenizer)
    return [] if list(output_ids[-len(end):]) == end else end


def continuation_ids(tokenizer, history: list[dict], messages: list[dict], tools=None, *, end_of_turn: str,
                     chat_template: str | None = None, tools_as_text: bool = False) -> list[int] | None:
    """The tokens of `messages` (with the generation prompt) that follow the end-of-turn token of
    `history`'s last message, an assistant turn; `history` must be a prefix of `messages`. None when
    the template renders `history` differently inside `messages` (then the caller starts over)."""
    before = render_text(tokenizer, history, tools, add_generation_prompt=False, chat_template=chat_template,
                         tools_as_text=tools_as_text)
    after = render_text(tokenizer, messages, tools, add_generation_prompt=True, chat_template=chat_template,
                        tools_as_text=tools_as_text)
    cut = before.rfind(end_of_turn)
    if cut < 0:
        return None
    cut += len(end_of_turn)
    if not after.startswith(before[:cut]):
        return None
    return encode(tokenizer, after[cut:])


# --- tools for a template without a tools section ---
TOOLS_INSTRUCTION = 'Call a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call>'


def template_renders_tools(tokenizer, chat_template: str | None = None) -> bool:
    """Whether the template shows the model a `tools` list and assistant `tool_calls`; if not, the
    caller renders with tools_as_text. A probe conversation (ids of nine letters and digits, as
    Mistral's templates demand) must show both names; a template that cannot render it has no
    usable tools section either."""
    tool = {"type": "function", "function": {"name": "probe_tool_7f3a", "description": "probe",
                                             "parameters": {"type": "object", "properties": {}}}}
    call = {"id": "call7f3a0", "type": "function", "function": {"name": "probe_call_7f3a", "arguments": {}}}
    try:
        listed = render_text(tokenizer, [{"role": "user", "content": "hi"}], [tool], add_generation_prompt=True,
                             chat_template=chat_template)
        called = render_text(tokenizer, [{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": "", "tool_calls": [call]}], [tool],
                             add_generation_prompt=False, chat_template=chat_template)
    except ChatFormatError:
        return False
    return "probe_tool_7f3a" in listed and "probe_call_7f3a" in called


def _call_text(call: dict) -> str:
    fn = call["function"]
    return (f'<tool_call>{{"name": {json.dumps(fn["name"], ensure_ascii=False)}, '
            f'"arguments": {json.dumps(fn["arguments"], ensure_ascii=False)}}}</tool_call>')


def with_tools_as_text(messages: list[dict], tools=None) -> list[dict]:
    """Template messages with tools written into their text, for a template that renders only
    roles and content; on ChatML it gives exactly what lib.tiny_model.TOOLS_CHAT_TEMPLATE renders.
    The tool list (one function schema as JSON a line) and TOOLS_INSTRUCTION close the system
    message (a new one first if there is none), assistant tool calls follow the assistant's text as
    `<tool_call>` blocks (the format parse_tool_calls reads back), and each run of tool results is
    one user turn of `<tool_response>` blocks (ChatML templates would give role tool a turn the
    model never saw in training, or drop it)."""
    out = []
    if tools:
        listing = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        block = f"# Tools\n<tools>\n{listing}\n</tools>\n{TOOLS_INSTRUCTION}"
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + block})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    previous = None
    for m in messages:
        if m["role"] == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if previous == "tool":
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": m["content"] + "".join(_call_text(c) for c in m["tool_calls"])})
        else:
            out.append({"role": m["role"], "content": m["content"]})
        previous = m["role"]
    return out


# --- the model's tool calls ---
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def parse_tool_calls(text: str):
    """(content, tool_calls) from a model turn in Qwen2.5's format, `<tool_call>{"name": ..,
    "arguments": {..}}</tool_call>` (one block per call). `tool_calls` is None, and `content` the
    whole text, when there is no block or any block does not parse (arguments nested deeper than
    MAX_JSON_DEPTH, or an escaped lone surrogate, included): the agent's code decides what a
    malformed call means. `content` is
    None when nothing but tool calls was written (as OpenAI does). Never raises; linear time (a
    regex with a lazy `.*?` is quadratic on thousands of unclosed `<tool_call>`, one token each)."""
    calls, outside, pos = [], [], 0
    while (start := text.find(_OPEN, pos)) >= 0:
        end = text.find(_CLOSE, start + len(_OPEN))
        call = _read_call(text[start + len(_OPEN):end]) if end >= 0 else None  # never closed: cut by length
        if call is None:
            return text, None
        calls.append(call)
        outside.append(text[pos:start])
        pos = end + len(_CLOSE)
    if not calls:
        return text, None
    content = "".join(outside) + text[pos:]
    if _OPEN in content:  # made by cutting a block out (`<tool_` + block + `call>`): not a clean call
        return text, None
    return content.strip() or None, calls


def _read_call(block: str) -> dict | None:
    """One `<tool_call>` block's JSON as an OpenAI tool call, or None if it is not one."""
    try:
        call = json.loads(block)
        args = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(args, str):
            args = json.loads(args)
    except (ValueError, RecursionError):  # not JSON, or nested past what json.loads can read
        return None
    if (not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]
            or not isinstance(args, dict) or nesting(args) > MAX_JSON_DEPTH):
        return None
    # An escaped lone surrogate (`"\ud800"`) is no text: the call could be neither sent as UTF-8 nor
    # rendered back into the next prompt. The model's text, which is valid, goes out as content instead.
    if lone_surrogate(call) is not None or lone_surrogate(args) is not None:
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


# --- sampled tokens as OpenAI's logprobs show them ---
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes stand for themselves,
    the rest are shifted past 255 (' ' is 'Ġ', '\\n' is 'Ċ')."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {chr(b): b for b in kept}, 0
    for b in range(256):
        if b not in kept:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def token_bytes_reader(tokenizer):
    """A function id -> (text, bytes) of one token as OpenAI's `logprobs` give it: the UTF-8 bytes the
    token adds to the text (not the vocabulary's spelling: byte-level BPE writes ' he' as 'Ġhe',
    SentencePiece as '▁he' and a lone byte as '<0xE2>'), and those bytes as text, or `bytes:\\xe2\\x80`
    for a token that holds part of a character. Answers are cached per id."""
    import re

    from tokenizers import decoders

    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    parts = [decoder] if not isinstance(decoder, decoders.Sequence) else []
    if isinstance(decoder, decoders.Sequence):  # no public accessor for its parts: read its JSON
        parts = [d["type"] for d in json.loads(tokenizer.backend_tokenizer.to_str())["decoder"]["decoders"]]
    byte_level = isinstance(decoder, decoders.ByteLevel) or "ByteLevel" in parts
    table = _byte_level_table() if byte_level else {}
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    byte_token = re.compile(r"<0x([0-9A-Fa-f]{2})>")
    cache: dict[int, tuple[str, list[int]]] = {}

    def read(token_id: int) -> tuple[str, list[int]]:
        if token_id in cache:
            return cache[token_id]
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if token_id in added or piece is None:
            raw = (added.get(token_id) or tokenizer.decode([token_id])).encode()
        elif byte_level and all(c in table for c in piece):
            raw = bytes(table[c] for c in piece)
        elif match := byte_token.fullmatch(piece):  # SentencePiece's byte fallback
            raw = bytes([int(match.group(1), 16)])
        elif not byte_level and "▁" in piece:  # SentencePiece's word boundary
            raw = piece.replace("▁", " ").encode()
        else:
            raw = tokenizer.decode([token_id]).encode()
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        cache[token_id] = text, list(raw)
        return cache[token_id]
    return read
