"""train_reflect.py's agent written with the openai SDK, run in a proxy session (lib/openai_proxy.py):
chat messages in, text out, no token in sight. For the same sampled tokens its one segment is
train_reflect.arun_episode's trajectory, id for id (tests/test_reflect.py checks it, over three
HTTP transports); bench/bench_proxy.py times it against the token loop. Not a training path of
its own: an agent of yours trains through train_agent.py."""
import asyncio

import torch

import train_reflect as tr
from lib.async_rollout import gather_groups
from lib.deadlines import with_deadline
from lib.openai_proxy import sdk_aiohttp_client

_openai_clients: dict = {}  # (proxy url, event loop, http_client) -> AsyncOpenAI


def openai_client(proxy, http_client: str = "aiohttp"):
    """One SDK client (one connection pool) per event loop for every episode: building an
    AsyncOpenAI takes ~40 ms (an SSL context), a copy with another api_key (`with_options`) ~0.04 ms.
    `http_client`: "aiohttp" is the SDK's own aiohttp transport (`DefaultAioHttpClient`, the
    `openai[aiohttp]` extra), "httpx" its default one, "in_process" the proxy's own client that
    hands requests to it without a socket (`proxy.http_client()`). The default httpx pool walks
    every pooled connection on each request and response, and with one connection per concurrent
    episode that was a third of the proxy path's cost (docs/benchmarks.md). Close with
    `close_openai_clients()`."""
    from openai import AsyncOpenAI

    loop = asyncio.get_running_loop()
    key = (proxy.url, loop, http_client)
    if key not in _openai_clients:
        if http_client not in ("aiohttp", "httpx", "in_process"):
            raise ValueError(f"openai_http_client must be 'aiohttp', 'httpx' or 'in_process', got {http_client!r}")
        transport = None  # "httpx": the SDK's default client
        if http_client == "in_process":
            transport = proxy.http_client()
        elif http_client == "aiohttp":
            transport = sdk_aiohttp_client()
        _openai_clients[key] = AsyncOpenAI(base_url=proxy.url, api_key="per-episode", max_retries=0,
                                           http_client=transport)
    return _openai_clients[key]


async def close_openai_clients():
    """Close the SDK clients of the running event loop (their connection pools)."""
    loop = asyncio.get_running_loop()
    for key in [k for k in _openai_clients if k[1] is loop]:
        await _openai_clients.pop(key).close()


async def run_agent(base_url: str, api_key: str, item: dict, temperature: float, *, sdk, reward_pool,
                    cfg) -> dict:
    """arun_episode's loop as an agent author writes it, in train_agent.py's shape (a run_agent against
    the episode's base URL and key; here also the shared SDK client `sdk` to copy, the reward pool
    and the config): chat messages in, text out, no token in sight. Returns the reward and the
    episode's stats."""
    from openai import BadRequestError  # only this path needs the SDK

    llm = sdk.with_options(base_url=base_url, api_key=api_key)
    messages = [{"role": "user", "content": tr.PROMPT_TEMPLATE.format(question=item["question"])}]
    score, turns, finish, texts = 0.0, 0, "max_turns", []
    for turn in range(cfg.max_turns):
        try:
            reply = await llm.chat.completions.create(model="policy", messages=messages, temperature=temperature,
                                                      max_tokens=cfg.max_new_tokens_per_turn)
        except BadRequestError as e:
            if e.code != "context_length_exceeded":  # the proxy's context budget is cfg.max_tokens
                raise
            finish = "max_tokens"
            break
        turns += 1
        text = reply.choices[0].message.content or ""
        texts.append(text)
        score = await reward_pool.score(tr.reward_fn, text, item["answer"])
        if score > 0:
            finish = "correct"
            break
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": tr.REFLECTION}]
    return {
        "reward": score * cfg.turn_discount ** (turns - 1) if turns else 0.0,
        "num_turns": turns,
        "correct_turn": turns if score > 0 else 0,
        "shows_work": bool(texts) and tr.shows_work(texts[0]),
        "finish_reason": finish,
        "turn_texts": texts,
    }


async def arun_episode_openai(proxy, reward_pool, cfg, item: dict, temperature: float,
                              http_client: str = "aiohttp") -> dict:
    """run_agent in a proxy session of its own, as train_agent.py runs an episode. The proxy renders
    the messages with the chat template, keeps the tokens the server sampled, and hands back the
    session's `segments` (one per unbroken conversation: this agent only appends, so one), each a
    training row with the episode's reward; for the same sampled tokens the segment is
    arun_episode's trajectory, id for id (tests/test_reflect.py checks)."""
    # A training session samples at the trainer's temperature only (the proxy refuses others);
    # evaluation (greedy) is not trained on.
    key = proxy.new_session(train=temperature != 0.0)
    try:
        result = await run_agent(proxy.session_url(key), key, item, temperature, reward_pool=reward_pool, cfg=cfg,
                                 sdk=openai_client(proxy, http_client))
    finally:
        episode = proxy.end_session(key)
    segments = episode["segments"]
    return {
        "segments": segments,
        # every sampled token's version, for the async producer's staleness check
        "versions": torch.cat([s["versions"] for s in segments], 1) if segments else torch.zeros(1, 0, dtype=torch.long),
        "rewards": torch.tensor([result.pop("reward")], dtype=torch.float32),
        **result,
        "question": item["question"],
        "gold": item["answer"],
    }


async def rollout_groups_openai(proxy, reward_pool, cfg, items: list[dict], temperature: float, group_size: int,
                                http_client: str = "aiohttp"):
    """(groups, failed) as train_reflect.rollout_groups gives them, each episode by the SDK agent."""
    return await gather_groups([asyncio.gather(*[with_deadline(arun_episode_openai(
        proxy, reward_pool, cfg, item, temperature, http_client), cfg.episode_timeout_s, item)
        for _ in range(group_size)]) for item in items])
