"""The three APIs' streamed events of lib/openai_proxy.py (OpenAI's server-sent event shapes): chat
completion chunks, text completion chunks and the Responses API's events, built from a reply as it is
generated (`start`, `delta`, `end_choice`, `end`), and the usage and legacy log-prob objects their
plain replies share. Nothing here records or samples anything: lib/proxy_record.py keeps the tokens.
"""
import itertools
import time
import uuid


def usage_of(plan: dict, turns: list[dict]) -> dict:
    completion = sum(len(t["gen"].output_ids) for t in turns)
    return {"prompt_tokens": len(plan["prompt"]), "completion_tokens": completion,
            "total_tokens": len(plan["prompt"]) + completion}


def legacy_logprobs(entries: list[dict], offset: int) -> dict:
    """/v1/completions' logprobs of these entries, the first token's text at character `offset`."""
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries]
            if any(e["top_logprobs"] for e in entries) else None,
            "text_offset": list(itertools.accumulate((len(e["token"]) for e in entries[:-1]), initial=offset))[:len(entries)]}


class ChatChunks:
    done = True  # then `data: [DONE]`

    def __init__(self, model: str, completion_id: str, created: int, params: dict):
        self.base = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model}
        self.params = params

    def chunk(self, i: int, delta: dict, finish=None, logprobs=None) -> dict:
        return {**self.base, "choices": [{"index": i, "delta": delta, "finish_reason": finish,
                                          "logprobs": {"content": logprobs} if logprobs is not None else None}]}

    def start(self) -> list[dict]:
        return [self.chunk(i, {"role": "assistant", "content": ""}) for i in range(self.params["n"])]

    def delta(self, i: int, kind: str, text: str, logprobs: list) -> list[dict]:
        return [self.chunk(i, {"reasoning_content" if kind == "reasoning" else "content": text},
                           logprobs=logprobs if self.params["logprobs"] else None)]

    def end_choice(self, i: int, turn: dict, logprobs: list) -> list[dict]:
        calls, logprobs = turn["message"].get("tool_calls"), logprobs if self.params["logprobs"] else None
        chunks = [self.chunk(i, {"tool_calls": [{"index": j, **call} for j, call in enumerate(calls)]},
                             logprobs=logprobs)] if calls else []
        return chunks + [self.chunk(i, {}, turn["finish"], logprobs=None if calls else logprobs)]

    def end(self, plan: dict, turns: list[dict]) -> list[dict]:
        return [{**self.base, "choices": [], "usage": usage_of(plan, turns)}] if self.params["include_usage"] else []


class CompletionChunks:
    done = True

    def __init__(self, model: str, completion_id: str, created: int, params: dict, prompt_chars: int):
        self.base = {"id": completion_id, "object": "text_completion", "created": created, "model": model}
        self.params = params
        self.offsets = [prompt_chars] * params["n"]  # per choice: where its next token's text starts

    def chunk(self, i: int, text: str, logprobs: list, finish=None) -> dict:
        legacy = None
        if self.params["logprobs"]:
            legacy = legacy_logprobs(logprobs, self.offsets[i])
            self.offsets[i] += sum(len(e["token"]) for e in logprobs)
        return {**self.base, "choices": [{"index": i, "text": text, "finish_reason": finish, "logprobs": legacy}]}

    def start(self) -> list[dict]:
        return []

    def delta(self, i: int, kind: str, text: str, logprobs: list) -> list[dict]:
        return [self.chunk(i, text, logprobs)]

    def end_choice(self, i: int, turn: dict, logprobs: list) -> list[dict]:
        return [self.chunk(i, "", logprobs, turn["finish"])]

    def end(self, plan: dict, turns: list[dict]) -> list[dict]:
        return [{**self.base, "choices": [], "usage": usage_of(plan, turns)}] if self.params["include_usage"] else []


class ResponseEvents:
    """A Responses API answer, whole (`finished`) or as the events the SDKs parse: created, then
    each output item (a reasoning item, its text delta by delta; the message, its text delta by
    delta; function calls), then completed."""
    done = False

    def __init__(self, model: str, body: dict, params: dict):
        self.model, self.body, self.params = model, body, params
        self.response_id, self.created = "resp_" + uuid.uuid4().hex, int(time.time())
        self.item_ids = {"reasoning": "rs_" + uuid.uuid4().hex, "message": "msg_" + uuid.uuid4().hex}
        self.sequence, self.index = 0, 0  # events sent; output items opened
        self.reasoning, self.message = "", None  # thinking so far; the message's output index once opened
        self.thinking, self.thought = None, False  # the reasoning item's output index once opened; closed yet
        self.logprobs = []

    def finished(self, plan: dict, turns: list[dict]) -> dict:
        [turn] = turns
        message, output = turn["message"], []
        if message.get("reasoning_content"):
            output.append({"type": "reasoning", "id": self.item_ids["reasoning"], "status": "completed", "summary": [],
                           "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]})
        if message["content"] or not message.get("tool_calls"):  # an empty reply is an empty message, as OpenAI's
            output.append({"type": "message", "id": self.item_ids["message"], "role": "assistant", "status": "completed",
                           "content": [{"type": "output_text", "text": message["content"] or "", "annotations": [],
                                        "logprobs": turn["logprobs"] if self.params["logprobs"] else []}]})
        for call in message.get("tool_calls", []):
            output.append({"type": "function_call", "id": "fc_" + call["id"], "call_id": call["id"],
                           "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                           "status": "completed"})
        usage = usage_of(plan, turns)
        incomplete = turn["finish"] == "length"
        return {**self.skeleton(), "status": "incomplete" if incomplete else "completed", "output": output,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": usage["total_tokens"]}}

    def skeleton(self) -> dict:
        body, sampling = self.body, self.params["sampling"]
        return {"id": self.response_id, "object": "response", "created_at": self.created, "model": self.model,
                "status": "in_progress", "output": [], "error": None, "incomplete_details": None,
                "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
                "parallel_tool_calls": True, "temperature": sampling["temperature"], "top_p": sampling["top_p"],
                "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
                "max_output_tokens": body.get("max_output_tokens"), "text": {"format": {"type": "text"}},
                "truncation": "disabled", "usage": None}

    def event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.skeleton()),
                self.event("response.in_progress", response=self.skeleton())]

    def item(self, item: dict) -> list[dict]:
        """A whole output item, added and done."""
        self.index += 1
        return [self.event("response.output_item.added", output_index=self.index - 1, item=item),
                self.event("response.output_item.done", output_index=self.index - 1, item=item)]

    def open_reasoning(self) -> list[dict]:
        self.thinking, self.index = self.index, self.index + 1
        item = {"type": "reasoning", "id": self.item_ids["reasoning"], "status": "in_progress", "summary": [],
                "content": []}
        return [self.event("response.output_item.added", output_index=self.thinking, item=item),
                self.event("response.content_part.added", item_id=item["id"], output_index=self.thinking,
                           content_index=0, part={"type": "reasoning_text", "text": ""})]

    def close_reasoning(self) -> list[dict]:
        """The reasoning item's done events, once: its thinking is over (the message begins, or the reply ends)."""
        if self.thinking is None or self.thought:
            return []
        self.thought = True
        part = {"type": "reasoning_text", "text": self.reasoning}
        ids = {"item_id": self.item_ids["reasoning"], "output_index": self.thinking, "content_index": 0}
        item = {"type": "reasoning", "id": self.item_ids["reasoning"], "status": "completed", "summary": [],
                "content": [part]}
        return [self.event("response.reasoning_text.done", **ids, text=self.reasoning),
                self.event("response.content_part.done", **ids, part=part),
                self.event("response.output_item.done", output_index=self.thinking, item=item)]

    def open_message(self) -> list[dict]:
        events = self.close_reasoning()
        self.message, self.index = self.index, self.index + 1
        item = {"type": "message", "id": self.item_ids["message"], "role": "assistant", "status": "in_progress",
                "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return events + [self.event("response.output_item.added", output_index=self.message, item=item),
                         self.event("response.content_part.added", item_id=item["id"], output_index=self.message,
                                    content_index=0, part=part)]

    def delta(self, i: int, kind: str, text: str, logprobs: list) -> list[dict]:
        if kind == "reasoning":
            if self.thought or not text:
                return []  # no thinking after the message began (ReplyText sends it all before)
            events = self.open_reasoning() if self.thinking is None else []
            self.reasoning += text
            return events + [self.event("response.reasoning_text.delta", item_id=self.item_ids["reasoning"],
                                        output_index=self.thinking, content_index=0, delta=text)]
        events = self.open_message() if self.message is None else []
        return events + [self.event("response.output_text.delta", item_id=self.item_ids["message"],
                                    output_index=self.message, content_index=0, delta=text, logprobs=logprobs)]

    def end_choice(self, i: int, turn: dict, logprobs: list) -> list[dict]:
        self.logprobs = logprobs  # sent with the message's last delta, in end()
        return []

    def end(self, plan: dict, turns: list[dict]) -> list[dict]:
        response = self.finished(plan, turns)
        events, logprobs = [], self.logprobs
        for item in response["output"]:
            if item["type"] == "reasoning":
                if self.thinking is None:  # none of it was streamed: the whole item
                    events += self.item(item)
                    self.thinking, self.thought = self.index - 1, True
                events += self.close_reasoning()
            elif item["type"] == "message":
                if self.message is None:
                    events += self.open_message()
                part, ids = item["content"][0], {"item_id": item["id"], "output_index": self.message, "content_index": 0}
                if logprobs:  # tokens whose text sent nothing new (an end of turn): their log-probs still go out
                    events.append(self.event("response.output_text.delta", **ids, delta="", logprobs=logprobs))
                events += [self.event("response.output_text.done", **ids, text=part["text"], logprobs=part["logprobs"]),
                           self.event("response.content_part.done", **ids, part=part),
                           self.event("response.output_item.done", output_index=self.message, item=item)]
            elif item["type"] == "function_call":
                self.index += 1
                at = self.index - 1
                events += [self.event("response.output_item.added", output_index=at,
                                      item={**item, "status": "in_progress", "arguments": ""}),
                           self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                                      delta=item["arguments"]),
                           self.event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                      name=item["name"], arguments=item["arguments"]),
                           self.event("response.output_item.done", output_index=at, item=item)]
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return events + [self.event(kind, response=response)]
