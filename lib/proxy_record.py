"""What lib/openai_proxy.py records of a session, in one place: every token the policy sampled is in
exactly one segment, with loss_mask 1, the log-prob the server reported and the policy version, and
every other token (prompt, tool results, the template's pieces) with loss_mask 0.

A `Session` (one episode) holds `Segment`s (one per unbroken conversation) and the `Turn`s recorded
into them. `record` keeps one reply as its answer is handed to the client: appended in place when
its request continues a segment's latest state, else a new segment whose prompt is context only.
`discarded_turns` tells the replies the agent did not go on from; `episode_of` turns the session
into the episode end_session returns.
"""
import collections

import torch


class Segment:
    def __init__(self, ids, mask, logprobs, versions):
        self.ids, self.mask, self.logprobs, self.versions = ids, mask, logprobs, versions
        # After each reply: (message keys through the reply, tools key, token count, closed by a stop token)
        self.states: list[tuple[tuple, str, int, bool]] = []
        self.text_states: list[tuple[str, int]] = []  # /v1/completions: (prompt + completion text, token count)
        self.busy = False  # a request is generating on it: a concurrent one forks instead
        # The template's text of the conversation before its latest state's reply, through the last end
        # of turn (None if unknown): a request that continues that state renders only its own messages.
        self.rendered: str | None = None
        self.turn_ends: dict[int, Turn] = {}  # token count after each recorded turn -> that turn


class Turn:
    """One recorded reply: where its sampled tokens are (`segment.ids[start:end]`), the turn whose
    state its request continued (`parent`, None for a fresh rendering), its request's prompt as the
    template saw it (`context`), the request's order among the session's recorded ones and its choice
    index. What end_session needs to tell the replies the agent went on from from those it discarded."""
    __slots__ = ("segment", "start", "end", "parent", "context", "request", "choice")

    def __init__(self, segment, start, end, parent, context, request, choice):
        self.segment, self.start, self.end, self.parent = segment, start, end, parent
        self.context, self.request, self.choice = context, request, choice


class Session:
    def __init__(self, key: str, train: bool):
        self.key, self.train = key, train
        self.segments: list[Segment] = []
        self.turns: list[Turn] = []  # in the order they were recorded
        self.recorded_requests = 0
        self.reward = None
        self.error = None
        self.stats = {"requests": 0, "completion_tokens": 0, "tool_calls": 0, "tool_call_parse_failures": 0,
                      "length_cut": 0, "new_segments": 0}


def record_all(session: Session, plan: dict, turns: list[dict], end_of_turn: str):
    """Keep the turns of one request whose answer was sent (its `n` choices): the first continues the
    record in place when it can, the others fork."""
    session.recorded_requests += 1
    for choice, turn in enumerate(turns):
        record(session, plan, turn, choice, end_of_turn)


def record(session: Session, plan: dict, turn: dict, choice: int, end_of_turn: str):
    """Keep a turn whose answer was sent: its tokens, the session's counts, the state it leaves."""
    gen = turn["gen"]
    out = list(gen.output_ids)
    segment = plan["segment"]
    parent = segment.turn_ends.get(plan["prefix"]) if segment is not None else None
    if segment is not None and plan["in_place"] and len(segment.ids) == plan["prefix"]:
        n = len(plan["delta"])
        segment.ids += plan["delta"]
        segment.mask += [0] * n
        segment.logprobs += [0.0] * n
        segment.versions += [-1] * n
    else:
        # A new segment: the prompt as context only. Tokens sampled earlier keep their single
        # trained copy in the segment they were recorded in.
        prompt = plan["prompt"]
        segment = Segment(list(prompt), [0] * len(prompt), [0.0] * len(prompt), [-1] * len(prompt))
        session.segments.append(segment)
        session.stats["new_segments"] += 1
    start = len(segment.ids)
    segment.ids += out
    segment.mask += [1] * len(out)
    segment.logprobs += list(gen.logprobs)
    segment.versions += list(gen.versions)
    session.stats["requests"] += 1
    session.stats["completion_tokens"] += len(out)
    session.stats["tool_calls"] += len(turn["message"].get("tool_calls", []))
    session.stats["tool_call_parse_failures"] += turn["parse_failed"]
    session.stats["length_cut"] += turn["finish"] == "length"
    context = plan["text"] if plan["text"] is not None else (plan["keys"], plan["tools_key"])
    recorded = Turn(segment, start, len(segment.ids), parent, context, session.recorded_requests, choice)
    session.turns.append(recorded)
    segment.turn_ends[len(segment.ids)] = recorded
    if plan["text"] is not None:
        segment.text_states.append((plan["text"] + turn["text"], len(segment.ids)))
    else:
        segment.states.append((plan["keys"] + (turn["key"],), plan["tools_key"], len(segment.ids), turn["closed"]))
        segment.rendered = plan["rendered"] if end_of_turn in (plan["rendered"] or "") else None


def discarded_turns(turns: list[Turn]) -> list[Turn]:
    """The replies of a session the agent did not go on from (docs/openai_proxy.md, "What is
    trained"). Replies sampled for the same prompt (the same messages and tools, or the same text
    prompt, continuing the same reply) are alternatives: the `n` choices of one request, or a request
    sent again. Of each set the agent kept the one it went on from last (whose later requests
    continue it most recently); if it went on from none, the latest request's first choice (what an
    SDK's `choices[0]` reads). The others are discarded, and with them every reply whose
    conversation continued one of them. Replies to different prompts (another question, a sub-agent,
    a rewritten history) are never alternatives: each is kept."""
    latest = {id(t): t.request for t in turns}  # the latest request in each turn's subtree
    for t in reversed(turns):  # a reply is always recorded after the one it continues
        if t.parent is not None:
            latest[id(t.parent)] = max(latest[id(t.parent)], latest[id(t)])
    alternatives: dict = collections.defaultdict(list)
    for t in turns:
        alternatives[(id(t.parent), t.context)].append(t)
    superseded = set()
    for group in alternatives.values():
        if len(group) > 1:
            kept = max(group, key=lambda t: (latest[id(t)], -t.choice))
            superseded.update(id(t) for t in group if t is not kept)
    gone = set()
    for t in turns:
        if id(t) in superseded or (t.parent is not None and id(t.parent) in gone):
            gone.add(id(t))
    return [t for t in turns if id(t) in gone]


def episode_of(session: Session, train_discarded: bool) -> dict:
    """The session's episode: its segments as trajectories (docs/trajectory.md), the reward posted and
    its counts, the replies it did not go on from cut out unless `train_discarded`."""
    discarded = discarded_turns(session.turns)
    ends = {}  # per segment: where its kept part ends (discarded turns of a segment are its last ones)
    for turn in discarded if not train_discarded else []:
        ends[id(turn.segment)] = min(ends.get(id(turn.segment), turn.start), turn.start)
    t = lambda xs, dtype: torch.tensor([xs], dtype=dtype)  # noqa: E731
    segments = []
    for s in session.segments:
        n = ends.get(id(s), len(s.ids))
        while n < len(s.ids) and n and not s.mask[n - 1]:  # cut: the prompt of its first discarded reply goes too
            n -= 1
        if any(s.mask[:n]):
            segments.append({"input_ids": t(s.ids[:n], torch.long), "loss_mask": t(s.mask[:n], torch.long),
                             "logprobs": t(s.logprobs[:n], torch.float32),
                             "versions": t(s.versions[:n], torch.long),
                             "attention_mask": torch.ones(1, n, dtype=torch.long)})
    return {"segments": segments, "reward": session.reward, **session.stats, "discarded_turns": len(discarded)}
