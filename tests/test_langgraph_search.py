"""examples/langgraph_search.py: a LangGraph agent (ChatOpenAI + ToolNode) trained through the proxy.
Its tool calls reach the real retrieval server and come back rendered; the proxy's record of the
run is token-exact; two GRPO steps run end to end on the embedded default."""
import asyncio
import json
import os

import pytest

pytest.importorskip("langgraph")
pytest.importorskip("langchain_openai")

import examples.langgraph_search as lg  # noqa: E402
from lib.agent_episode import arun_episode  # noqa: E402
from lib.client import InferenceClient  # noqa: E402
from lib.openai_proxy import OpenAIProxy  # noqa: E402
from lib.scripted_server import Reply, ScriptedServer  # noqa: E402

ITEM = {"question": "Where was the founder of Eskar Circle born?", "answer": ["Hatarmor", "Hatarmor City"]}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from lib.tiny_model import TOOLS_CHAT_TEMPLATE, default_tiny_model_dir

    tok = AutoTokenizer.from_pretrained(default_tiny_model_dir())
    tok.chat_template = TOOLS_CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def retrieval(tmp_path_factory):
    from lib.retrieval import launch_retrieval_server

    corpus = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    rows = [("Eskar Circle", "Eskar Circle was founded by Ciqua Eskranden in 1915."),
            ("Ciqua Eskranden", "Ciqua Eskranden was born in Hatarmor in 1918."),
            ("Vantargor", "Vantargor is the capital of Belfar.")]
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f'"{t}"\n{x}'}) + "\n" for i, (t, x) in enumerate(rows)))
    server = launch_retrieval_server(str(corpus), timeout_s=60)
    yield server.address
    server.terminate()


def call(query):
    return Reply(f'<tool_call>{{"name": "search", "arguments": {{"query": "{query}"}}}}</tool_call>', eos=True)


def run_episodes(tokenizer, script, retrieval_addr, n=1, **cfg_overrides):
    cfg = lg.Config(**{"tool_retries": 1, **cfg_overrides})

    async def go(address):
        client = InferenceClient([address], max_retries=0)
        proxy = OpenAIProxy(client, tokenizer, max_context_tokens=cfg.max_tokens)
        await proxy.start()
        lg.start_agent(cfg, retrieval_addr)
        try:
            return await asyncio.gather(*[arun_episode(proxy, lg.run_agent, ITEM, cfg.temperature, train=True) for _ in range(n)])
        finally:
            await lg.close_agent()
            await proxy.close()
            await client.close()
    with ScriptedServer(tokenizer, script) as server:
        return asyncio.run(go(server.address)), server


def test_the_agents_tool_calls_reach_the_retrieval_server_and_the_run_is_recorded_token_exact(tokenizer, retrieval):
    script = [call("who founded Eskar Circle"), call("where was Ciqua Eskranden born"), Reply("Hatarmor", eos=True)]
    [episode], server = run_episodes(tokenizer, script, retrieval)
    assert episode["reward"] == 1.0 and episode["requests"] == 3
    assert episode["stats"] == {"f1": 1.0, "searches": 2, "tool_failures": 0, "answered": True,
                                "finish_reason": "answer", "answer": "Hatarmor"}
    [segment] = episode["segments"]
    ids, mask = segment["input_ids"][0].tolist(), segment["loss_mask"][0].bool()
    assert segment["input_ids"][0][mask].tolist() == [t for a in server.answers for t in a["output_ids"]]
    for body in server.requests:
        assert ids[:len(body["input_ids"])] == body["input_ids"]
    text = tokenizer.decode(ids)
    assert "<tool_response>\nDoc 1 (Title: Eskar Circle) Eskar Circle was founded by Ciqua Eskranden" in text
    assert "Ciqua Eskranden was born in Hatarmor" in text.split("<tool_response>")[2]  # the second search's result
    assert '"name": "search"' in text.split("<|im_start|>user")[0]  # ChatOpenAI's tool schema, rendered


def test_a_failing_search_is_a_tool_message_the_agent_reads_and_is_counted(tokenizer):
    [episode], _ = run_episodes(tokenizer, [call("anything"), Reply("no idea", eos=True)], "http://127.0.0.1:9")
    assert episode["stats"]["tool_failures"] == 1 and episode["stats"]["finish_reason"] == "answer"
    text = tokenizer.decode(episode["segments"][0]["input_ids"][0])
    assert "<tool_response>\nThe search tool failed" in text and episode["reward"] == 0.0


def test_an_agent_that_keeps_calling_tools_ends_at_max_turns_and_keeps_its_tokens(tokenizer, retrieval):
    [episode], server = run_episodes(tokenizer, [call("Eskar Circle")], retrieval, max_turns=2)
    assert episode["stats"]["finish_reason"] == "max_turns" and episode["reward"] == 0.0
    assert len(server.requests) == 2 and len(episode["segments"]) == 1


@pytest.mark.slow
def test_two_grpo_steps_of_the_langgraph_agent_run_end_to_end_in_agent_worker_processes(tmp_path):
    run_dir = str(tmp_path / "run")
    # agent_workers: the agent runs in two processes, each given the settings and the retrieval server by start_agent
    result = lg.main(config="configs/langgraph_search_tiny.yaml", run_dir=run_dir, max_steps=2, batch_size=2,
                     group_size=2, max_turns=3, warm_start_steps=4, warm_start_batch_size=2, eval_every=0,
                     test_size=2, checkpoint_every=0, tensorboard=False, trainer_threads=1, warm_start_worlds=0,
                     agent_workers=2)
    assert result["failed"] == 0 and {"reward", "f1", "searches", "answered", "tool_failures"} <= set(result)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "rollout/reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/failed_groups"] == 0 and r["rollout/gen_tokens"] > 0 and r["rollout/episodes"] == 4
        assert r["logprob/server_trainer_abs_diff_mean"] < 0.05
        assert 0 <= r["rollout/answered"] <= 1 and r["rollout/searches"] >= 0  # the agent's own stats
    traces = [json.loads(line) for line in open(os.path.join(run_dir, "traces.jsonl"))]
    assert len(traces) >= 2 * 2  # one group of 2 episodes per step, a record per segment
    assert traces[0]["tokens"]["tlp"] is not None and '"name": "search"' in traces[0]["prompt"]
    from lib.viewer import render_page  # the viewer shows the example's run: its plots and its conversations

    page = render_page([run_dir], {}, {})
    assert "rollout/searches" in page and 'class="group" data-step="2"' in page
