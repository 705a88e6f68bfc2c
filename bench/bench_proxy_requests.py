"""Where an OpenAI-proxy request's cost goes: the same single-turn chat request sent N at a time
along each path, against lib.scripted_server in another process (no model, so only the request
handling is timed), wall and CPU time of this process per request.

    python bench/bench_proxy_requests.py            # 128 concurrent requests, 32 tokens each, 3 repetitions
    python bench/bench_proxy_requests.py --model-path tiny --turns 4 --responses   # no warm start to build; 4-turn conversations

Paths: `tokens` (lib's client posting the prompt ids, as the token loop does), `proxy handler`
(the proxy's handler called in-process with a stand-in client that answers at once: what the proxy
itself costs, with no HTTP, no SDK and no inference client), `raw http` (an
aiohttp client posting the chat request to lib/openai_proxy.py: the proxy's own cost on top of
`tokens`), `sdk httpx`, `sdk aiohttp` and `sdk in_process` (the openai SDK posting it, over its
default httpx transport, over `DefaultAioHttpClient`, and handed to the proxy without a socket by
`proxy.http_client()`; train_reflect.openai_client builds each); with `--langchain`, LangChain's
ChatOpenAI over httpx and over aiohttp; with `--responses`, the openai SDK's Responses API
(`responses.create`, as the OpenAI Agents SDK calls it) over aiohttp. With `--turns N`, each
session is an N-turn conversation (each request continues the last: the proxy renders the history
and tokenizes only the new text), and the figures are per request. The paths alternate; the table gives the median repetition
after a warm-up one.
"""
import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import statistics
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import train_reflect as tr  # noqa: E402
from lib.client import Generation, InferenceClient  # noqa: E402
from lib.openai_proxy import OpenAIProxy  # noqa: E402

QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"
FOLLOW_UP = "\n<|im_start|>user\nCheck it.<|im_end|>\n<|im_start|>assistant\n"  # the token path's next turn


def serve(model_path: str, reply_tokens: int, address_queue):
    """The scripted server, in its own process: every request gets the same reply, then EOS."""
    import threading

    from transformers import AutoTokenizer

    from lib.scripted_server import Reply, ScriptedServer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    server = ScriptedServer(tokenizer, [Reply(ids=reply_ids(tokenizer, reply_tokens), eos=True)]).__enter__()
    address_queue.put(server.address)
    threading.Event().wait()


def reply_ids(tokenizer, reply_tokens: int) -> list[int]:
    """The reply every request gets, EOS not included."""
    return tokenizer("the answer is" + " seven" * reply_tokens, add_special_tokens=False)["input_ids"][:reply_tokens - 1]


class InstantClient:
    """lib.client.InferenceClient's generate, answered at once with `ids` then EOS."""

    def __init__(self, ids: list[int], eos: int):
        self.ids, self.eos = ids + [eos], eos

    async def generate(self, prompt, **_):
        n = len(self.ids)
        return Generation(output_ids=list(self.ids), logprobs=[-0.1] * n, finish_reason="stop", matched=self.eos, text="",
                          prompt_tokens=len(prompt), cached_tokens=0, weight_version="0", versions=[0] * n)

    def end_trajectory(self, key):
        pass


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrent", type=int, default=128)
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--langchain", action="store_true",
                   help="also langchain_openai.ChatOpenAI (requirements-agents.txt), built per episode as "
                        "examples/langgraph_search.py does, over its default httpx client and over a shared aiohttp one")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave out the gc.freeze() that train_reflect.main runs after its setup")
    p.add_argument("--responses", action="store_true", help="also the openai SDK's Responses API (responses.create) over aiohttp")
    p.add_argument("--turns", type=int, default=1, help="requests per session, each continuing the conversation")
    p.add_argument("--model-path", default="",
                   help="whose tokenizer and template: '' the embedded reflect warm start (built on first use: "
                        "minutes to hours on a CPU), 'tiny' the tiny model's (no build), or an HF model dir")
    args = p.parse_args()

    import aiohttp
    from transformers import AutoTokenizer

    from lib.tiny_model import default_tiny_model_dir

    if args.model_path == "tiny":
        model_path = default_tiny_model_dir()
    else:
        model_path = args.model_path or tr.warm_started_model(
            tr.load_config(tr.Config, "configs/reflect_tiny.yaml", {"warm_start_steps": 300}), default_tiny_model_dir(),
            embedded=True)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    spawn = multiprocessing.get_context("spawn")
    address_queue = spawn.Queue()
    server = spawn.Process(target=serve, args=(model_path, args.reply_tokens, address_queue), daemon=True)
    server.start()
    address = address_queue.get(timeout=120)
    messages = [{"role": "user", "content": tr.PROMPT_TEMPLATE.format(question=QUESTION)}]
    prompt_ids = tr.build_prompt_ids(tokenizer, QUESTION, True)
    eos = [tokenizer.eos_token_id]

    async def bench():
        client = InferenceClient([address])
        proxy = OpenAIProxy(client, tokenizer, stop_token_ids=eos, max_context_tokens=1024, default_max_tokens=64)
        await proxy.start()
        raw_http = aiohttp.ClientSession()
        if not args.no_gc_freeze:
            gc.freeze()  # as train_reflect.main does before its loop

        follow_up = tokenizer(FOLLOW_UP, add_special_tokens=False)["input_ids"]

        async def tokens():
            ids = list(prompt_ids)
            for _ in range(args.turns):
                gen = await client.generate(ids, max_new_tokens=64, temperature=0.0, stop_token_ids=eos)
                ids += gen.output_ids + follow_up

        def conversation(send):
            """`args.turns` requests of one conversation; `send(messages)` -> the reply's text."""
            async def run():
                history = list(messages)
                for _ in range(args.turns):
                    text = await send(history)
                    history += [{"role": "assistant", "content": text}, {"role": "user", "content": "Check it."}]
            return run

        instant = OpenAIProxy(InstantClient(reply_ids(tokenizer, args.reply_tokens), eos[0]), tokenizer,
                              stop_token_ids=eos, max_context_tokens=1024, default_max_tokens=64)

        async def handler():
            key = instant.new_session()

            async def send(history):
                body = json.dumps({"model": "policy", "messages": history, "max_tokens": 64, "temperature": 0}).encode()
                status, payload, record = await instant._answer("POST", "/v1/chat/completions", f"Bearer {key}", body)
                assert status == 200, payload
                record()  # as a transport does when it hands the answer over
                return payload["choices"][0]["message"]["content"]
            await conversation(send)()
            instant.end_session(key)

        async def raw():
            key = proxy.new_session()

            async def send(history):
                async with raw_http.post(f"{proxy.url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                         json={"model": "policy", "messages": history, "max_tokens": 64,
                                               "temperature": 0}) as response:
                    assert response.status == 200, await response.text()
                    return (await response.json())["choices"][0]["message"]["content"]
            await conversation(send)()
            proxy.end_session(key)

        def sdk(http_client):
            async def request():
                key = proxy.new_session()
                llm = tr.openai_client(proxy, http_client).with_options(api_key=key)

                async def send(history):
                    reply = await llm.chat.completions.create(model="policy", messages=history, max_tokens=64,
                                                              temperature=0)
                    return reply.choices[0].message.content
                await conversation(send)()
                proxy.end_session(key)
            return request

        async def responses():
            key = proxy.new_session()
            llm = tr.openai_client(proxy, "aiohttp").with_options(api_key=key)

            async def send(history):
                reply = await llm.responses.create(model="policy", input=history, max_output_tokens=64, temperature=0)
                return reply.output_text
            await conversation(send)()
            proxy.end_session(key)

        shared_aiohttp = None

        def langchain(http_client):
            async def request():
                from langchain_openai import ChatOpenAI
                nonlocal shared_aiohttp
                if http_client == "aiohttp" and shared_aiohttp is None:
                    from openai import DefaultAioHttpClient
                    shared_aiohttp = DefaultAioHttpClient()
                key = proxy.new_session()
                llm = ChatOpenAI(model="policy", base_url=proxy.url, api_key=key, temperature=0, max_tokens=64,
                                 max_retries=0, http_async_client=shared_aiohttp if http_client == "aiohttp" else None)
                async def send(history):
                    return (await llm.ainvoke(history)).content
                await conversation(send)()
                proxy.end_session(key)
            return request

        paths = {"tokens": tokens, "proxy handler": handler, "raw http": raw, "sdk httpx": sdk("httpx"), "sdk aiohttp": sdk("aiohttp"),
                 "sdk in_process": sdk("in_process")}
        if args.responses:
            paths["sdk aiohttp responses"] = responses
        if args.langchain:
            paths.update({"langchain httpx": langchain("httpx"), "langchain aiohttp": langchain("aiohttp")})
        per_request = {name: [] for name in paths}  # [(wall ms, cpu ms)] per repetition
        for repetition in range(args.repetitions + 1):  # the first warms up
            for name, one in paths.items():
                t0, c0 = time.perf_counter(), time.process_time()
                await asyncio.gather(*[one() for _ in range(args.concurrent)])
                if repetition:
                    requests = args.concurrent * args.turns
                    per_request[name].append((1e3 * (time.perf_counter() - t0) / requests,
                                              1e3 * (time.process_time() - c0) / requests))
        await raw_http.close()
        if shared_aiohttp is not None:
            await shared_aiohttp.aclose()
        await tr.close_openai_clients()
        await proxy.close()
        await client.close()
        return per_request

    try:
        per_request = asyncio.run(bench())
    finally:
        server.kill()
    print(f"\n{args.concurrent} concurrent sessions of {args.turns} turn(s), {args.reply_tokens} tokens a reply, "
          f"scripted server, {os.path.basename(model_path.rstrip('/'))}'s tokenizer; "
          f"median of {args.repetitions} repetitions, gc.freeze {'off' if args.no_gc_freeze else 'on'}")
    print("| path | wall ms / request | this process's CPU ms / request |")
    print("| --- | --- | --- |")
    for name, rows in per_request.items():
        print(f"| {name} | {statistics.median(r[0] for r in rows):.2f} | {statistics.median(r[1] for r in rows):.2f} |")


if __name__ == "__main__":
    main()
