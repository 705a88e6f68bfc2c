"""Retrieval throughput, index build time and memory over synthetic corpora of several sizes.

    python bench/bench_retrieval.py [--sizes 20000 1000000] [--num-queries 2000]

Per size, in a fresh process: build the synthetic corpus (lib.wiki_data), build the BM25 index
(cold, cache removed first), load it from the cache, then measure queries/s of `bm25_search`
in-process and of the HTTP server (`lib.retrieval`, launched as a child), at batch 1 (one query
per call or request, back to back) and batch 64 (64 queries per call or request), and with 64
concurrent single-query HTTP clients; the HTTP client is aiohttp, as in train_search.py. Queries are the hop queries of the generated train split,
i.e. what the search agent sends. Best of `--repeats` runs. Prints a markdown table.
"""
import argparse
import asyncio
import json
import os
import resource
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _rss_mb(pid: str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _best_qps(fn, num_queries: int, repeats: int) -> float:
    best_s = float("inf")
    for _ in range(repeats):
        start_s = time.perf_counter()
        fn()
        best_s = min(best_s, time.perf_counter() - start_s)
    return num_queries / best_s


def measure(num_passages: int, work_dir: str, num_queries: int, repeats: int) -> dict:
    import aiohttp

    from lib.retrieval import bm25_search, launch_retrieval_server, load_bm25
    from lib.wiki_data import build_wiki_data, read_jsonl

    out_dir = os.path.join(work_dir, f"wiki-{num_passages}")
    start_s = time.perf_counter()
    paths = build_wiki_data(out_dir, seed=0, num_passages=num_passages, num_questions=10000)
    corpus_build_s = time.perf_counter() - start_s
    shutil.rmtree(paths["corpus"] + ".bm25s", ignore_errors=True)

    rss_before_mb = _rss_mb()
    start_s = time.perf_counter()
    index = load_bm25(paths["corpus"])
    index_build_s = time.perf_counter() - start_s
    rss_after_mb = _rss_mb()
    del index
    start_s = time.perf_counter()
    index = load_bm25(paths["corpus"])
    index_load_s = time.perf_counter() - start_s

    pool = [q for item in read_jsonl(paths["train"]) for q in item["hop_queries"]]
    queries = [pool[i % len(pool)] for i in range(num_queries)]
    batches = [queries[i:i + 64] for i in range(0, len(queries), 64)]
    bm25_search(index, queries[:10], 5)  # warm up
    row = {"passages": num_passages, "corpus_mb": os.path.getsize(paths["corpus"]) / 2**20,
           "corpus_build_s": corpus_build_s, "index_build_s": index_build_s, "index_load_s": index_load_s,
           "index_rss_mb": rss_after_mb - rss_before_mb,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    row["inproc_b1_qps"] = _best_qps(lambda: [bm25_search(index, [q], 5) for q in queries], len(queries), repeats)
    row["inproc_b64_qps"] = _best_qps(lambda: [bm25_search(index, b, 5) for b in batches], len(queries), repeats)
    del index

    server = launch_retrieval_server(paths["corpus"], timeout_s=600, log_path=os.path.join(out_dir, "server.log"))
    try:
        url = server.address + "/retrieve"
        row["server_rss_mb"] = _rss_mb(str(server.process.pid))
        async def sequential(groups):
            async with aiohttp.ClientSession() as session:
                for g in groups:
                    async with session.post(url, json={"queries": g, "topk": 5}) as r:
                        r.raise_for_status()
                        await r.read()

        async def concurrent_clients(num_clients: int = 64):
            todo = list(queries)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=num_clients)) as session:
                async def client():
                    while todo:
                        q = todo.pop()
                        async with session.post(url, json={"queries": [q], "topk": 5}) as r:
                            r.raise_for_status()
                            await r.read()
                await asyncio.gather(*(client() for _ in range(num_clients)))

        asyncio.run(sequential([queries[:10]]))  # warm up
        row["http_b1_qps"] = _best_qps(lambda: asyncio.run(sequential([[q] for q in queries])), len(queries), repeats)
        row["http_b64_qps"] = _best_qps(lambda: asyncio.run(sequential(batches)), len(queries), repeats)
        row["http_c64_qps"] = _best_qps(lambda: asyncio.run(concurrent_clients()), len(queries), repeats)
        row["server_rss_mb"] = max(row["server_rss_mb"], _rss_mb(str(server.process.pid)))
    finally:
        server.terminate()
    return row


COLUMNS = [("passages", "passages", "{:,}"), ("corpus_mb", "corpus MB", "{:.0f}"),
           ("index_build_s", "index build s", "{:.1f}"), ("index_load_s", "load cached s", "{:.1f}"),
           ("index_rss_mb", "index RSS MB", "{:.0f}"), ("server_rss_mb", "server RSS MB", "{:.0f}"),
           ("inproc_b1_qps", "in-process q/s b1", "{:,.0f}"), ("inproc_b64_qps", "in-process q/s b64", "{:,.0f}"),
           ("http_b1_qps", "HTTP q/s b1", "{:,.0f}"), ("http_b64_qps", "HTTP q/s b64", "{:,.0f}"),
           ("http_c64_qps", "HTTP q/s 64 clients", "{:,.0f}")]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[20000, 1000000])
    p.add_argument("--num-queries", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work-dir", default="/tmp/agentrl-bench-retrieval")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # child: measure one size
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one, args.work_dir, args.num_queries, args.repeats)))
        return
    rows = []
    for size in args.sizes:  # a fresh process per size, so its memory figures are its own
        out = subprocess.run([sys.executable, __file__, "--one", str(size), "--num-queries", str(args.num_queries),
                              "--repeats", str(args.repeats), "--work-dir", args.work_dir],
                             check=True, capture_output=True, text=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"measured {size:,} passages (corpus built in {rows[-1]['corpus_build_s']:.1f} s)", file=sys.stderr)
    print("| " + " | ".join(name for _, name, _ in COLUMNS) + " |")
    print("|" + " ---: |" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(fmt.format(row[key]) for key, _, fmt in COLUMNS) + " |")


if __name__ == "__main__":
    main()
