"""What of a reply still being generated can be sent to the client: the streamed text of one
choice of lib/openai_proxy.py, so that its deltas, joined, are the text the finished reply gives.

The finished reply is read by rules that look ahead (a stop string is left out, `</think>` splits
the reasoning of a reply that thinks from its content, `split_reasoning`, a `<tool_call>` block becomes a tool call and the content around it is
stripped). So the text of the tokens so far is sent only up to where no later token can change
it: a tail that may begin a stop string or a tag, an incomplete UTF-8 character, whitespace that
a strip may drop, and everything after a `<tool_call>` wait for more tokens, or for the end,
where `finish` sends what the finished reply has beyond what was sent.

    stream = ReplyText(tokenizer, stop=["</answer>"], parse_tools=True, thinking=False)
    for ids in runs_of_new_tokens:
        for kind, delta in stream.add(ids):     # kind: "reasoning" | "content"
            ...
    for kind, delta in stream.finish(reasoning, content):   # the finished reply's fields
        ...
"""
THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START = "<tool_call>"


def thinks(text: str, thinking: bool | None) -> bool:
    """Does this reply think: the prompt opened `<think>` (`thinking`), or the reply begins with it?
    None: a text completion, which never does."""
    return thinking is not None and (thinking or text.startswith(THINK_START))


def split_reasoning(text: str, thinking: bool | None) -> tuple[str | None, str]:
    """(reasoning, content) of a finished reply's text, the one rule a plain answer and a stream
    (ReplyText, whose deltas join into these) both follow. A reply that thinks (`thinks`) has as
    reasoning its text before `</think>`, stripped, and as content what follows it; cut before
    `</think>` (by max_tokens or a stop string), all of it is reasoning and the content is empty. A
    reply that does not think has no reasoning (None): a `</think>` in it is text of its content."""
    if not thinks(text, thinking):
        return None, text
    reasoning, _, answer = text.partition(THINK_END)
    return reasoning.removeprefix(THINK_START).strip(), answer.lstrip()


def until(text: str, tag: str) -> str:
    """`text` before `tag`, or, where `tag` is not in it, without a tail that may begin `tag`."""
    at = text.find(tag)
    if at >= 0:
        return text[:at]
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return text[:-k]
    return text


class ReplyText:
    def __init__(self, tokenizer, *, stop: list[str] | None, parse_tools: bool, thinking: bool | None):
        """`thinking`: True where the prompt opened `<think>` (the reply begins inside its
        thinking), False where it did not, None for a text completion (no reasoning, no tools)."""
        self.tokenizer, self.parse_tools, self.thinking = tokenizer, parse_tools, thinking
        self.stop = [s for s in stop or [] if s]  # the server ignores an empty stop string
        self.longest_stop = max(map(len, self.stop), default=0)
        self.stop_at, self.stop_searched = None, 0  # where the first stop string begins; how far the text was searched
        self.ids: list[int] = []
        self.sent = {"reasoning": "", "content": ""}
        # A byte-level BPE decodes a token sequence as its bytes, so the text of the tokens so far is
        # the text up to the last whole character plus the decoding of the tokens since: each step
        # decodes its new tokens only (a whole decoding each step is quadratic in the reply's length).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.by_parts = (type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
                         and not getattr(tokenizer, "clean_up_tokenization_spaces", True))
        self.text, self.undecoded = "", []  # by parts: the text through the last whole character; the tokens since

    def add(self, ids: list[int]) -> list[tuple[str, str]]:
        """The deltas the tokens so far (these new `ids` appended) allow to send."""
        self.ids += ids
        if self.by_parts:
            self.undecoded += ids
            tail = self.tokenizer.decode(self.undecoded, skip_special_tokens=True)
            if not tail.endswith("\ufffd"):  # a character may be half
                self.text, self.undecoded = self.text + tail, []
            text = self.text
        else:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd")
        return self._deltas(*self._sendable(self._before_stop(text)))

    def _before_stop(self, text: str) -> str:
        """`text` before the first stop string, or without a tail that may begin one. Linear in the
        reply's length where the text is decoded by parts (it only grows): each call searches only
        the text a stop string may end in that the last one did not see, and a stop once found
        stays where it is (the server stops there)."""
        if not self.stop:
            return text
        if self.stop_at is None or not self.by_parts:
            start = max(self.stop_searched - self.longest_stop + 1, 0) if self.by_parts else 0
            found = [at for stop in self.stop if (at := text.find(stop, start)) >= 0]
            self.stop_at, self.stop_searched = min(found, default=None), len(text)
        if self.stop_at is not None:
            return text[:self.stop_at]
        keep = len(text)
        for stop in self.stop:  # a tail that may begin a stop string waits for more tokens
            at = text.find(stop[0], max(len(text) - len(stop) + 1, 0))
            while at >= 0 and not stop.startswith(text[at:]):
                at = text.find(stop[0], at + 1)
            keep = min(keep, len(text) if at < 0 else at)
        return text[:keep]

    def finish(self, reasoning: str | None, content: str | None) -> list[tuple[str, str]]:
        """The rest of the finished reply's `reasoning` and `content` beyond what was sent."""
        return self._deltas(reasoning or "", content or "")

    def _sendable(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of the finished reply that `text` already fixes (split_reasoning's rule)."""
        if self.thinking is None:
            return "", text
        if not self.thinking and THINK_START.startswith(text[:len(THINK_START)]):
            if len(text) < len(THINK_START):
                return "", ""  # may yet be "<think>": wait
        if thinks(text, self.thinking):
            reasoning, closed, answer = text.partition(THINK_END)
            if not closed:  # stripped at the end: leading whitespace goes now, trailing waits
                return until(reasoning.removeprefix(THINK_START), THINK_END).strip(), ""
            reasoning, text = reasoning.removeprefix(THINK_START).strip(), answer.lstrip()
        else:
            reasoning = ""
        if not self.parse_tools:
            return reasoning, text
        if text[:1].isspace():  # stripped if a tool call follows, kept if none does: only the end tells
            return reasoning, ""
        return reasoning, until(text, TOOL_CALL_START).rstrip()

    def _deltas(self, reasoning: str, content: str) -> list[tuple[str, str]]:
        out = []
        for kind, text in (("reasoning", reasoning), ("content", content)):
            sent = self.sent[kind]
            if len(text) > len(sent) and text.startswith(sent):
                out.append((kind, text[len(sent):]))
                self.sent[kind] = text
        return out
