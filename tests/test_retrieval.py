"""lib.retrieval: in-process BM25 over a jsonl corpus, and the server that answers Search-R1's
/retrieve and ASearcher's /access, launched as a child process, robust to bad and concurrent input.

One server (over a 2,000-passage synthetic corpus) serves the module; the recall test uses the
default-size corpus in-process.
"""
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import aiohttp
import pytest
import requests

from lib.retrieval import (access_page, bm25_search, build_app, launch_retrieval_server, load_bm25, parse_args,
                           read_corpus)
from lib.launch import free_port
from lib.wiki_data import build_wiki_data, read_jsonl

TIMEOUT_S = 30
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return build_wiki_data(str(tmp_path_factory.mktemp("wiki")), seed=0, num_passages=2000, num_questions=200)


@pytest.fixture(scope="module")
def index(small):
    return load_bm25(small["corpus"])


@pytest.fixture(scope="module")
def server(small, index, tmp_path_factory):
    handle = launch_retrieval_server(small["corpus"], timeout_s=60,
                                     log_path=str(tmp_path_factory.mktemp("log") / "retrieval.log"))
    yield handle
    handle.terminate()


def _post(server, path, body):
    return requests.post(server.address + path, json=body, timeout=TIMEOUT_S)


def _write_corpus(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


# --- in-process BM25 ---
def test_every_hop_fact_is_in_the_top_5_for_its_hop_query(tmp_path):
    paths = build_wiki_data(str(tmp_path))  # default size: 20k passages
    index = load_bm25(paths["corpus"])
    items = read_jsonl(paths["dev"]) + read_jsonl(paths["test"])
    queries = [q for item in items for q in item["hop_queries"]]
    support = [pid for item in items for pid in item["support"]]
    found = [pid in [d["id"] for d in docs] for pid, docs in zip(support, bm25_search(index, queries, 5))]
    rate = sum(found) / len(found)
    print(f"hop recall@5 over {len(found)} hops of {len(items)} dev+test questions: {rate:.4f}")
    assert rate >= 0.98


def test_results_are_best_first_and_carry_title_text_contents_url(index):
    results = bm25_search(index, ["where was Nobody Known born", "capital of"], 5, return_scores=True)
    for hits in results:
        scores = [h["score"] for h in hits]
        assert scores == sorted(scores, reverse=True) and all(s > 0 for s in scores)
        for hit in hits:
            doc = hit["document"]
            assert set(doc) == {"id", "title", "text", "contents", "url"}
            assert doc["contents"] == f'"{doc["title"]}"\n{doc["text"]}'


def test_a_query_sharing_no_term_with_the_corpus_gets_no_documents(index):
    assert bm25_search(index, ["zzqx qqzv", ""], 3) == [[], []]


def test_topk_beyond_the_corpus_size_returns_every_matching_passage(tmp_path):
    corpus = tmp_path / "c.jsonl"
    _write_corpus(corpus, [{"id": "a", "contents": '"Tarqua"\nTarqua is a city.'},
                           {"id": "b", "contents": '"Velmoria"\nVelmoria is a country.'}])
    assert [d["id"] for d in bm25_search(load_bm25(str(corpus)), ["city country"], 50)[0]] in (["a", "b"], ["b", "a"])


def test_corpus_with_title_and_text_fields_is_read_as_contents(tmp_path):
    corpus = tmp_path / "c.jsonl"
    _write_corpus(corpus, [{"id": 7, "title": "Tarqua", "text": "Tarqua is a city."}])
    assert read_corpus(str(corpus)).contents == ['"Tarqua"\nTarqua is a city.']
    assert read_corpus(str(corpus)).ids == ["7"]


def test_index_is_cached_beside_the_corpus_and_rebuilt_when_the_corpus_changes(tmp_path):
    corpus = tmp_path / "c.jsonl"
    _write_corpus(corpus, [{"id": "0", "contents": '"Tarqua"\nTarqua is a city.'}])
    load_bm25(str(corpus))
    meta = tmp_path / "c.jsonl.bm25s" / "agentrl_meta.json"
    stamp = os.path.getmtime(meta)
    load_bm25(str(corpus))
    assert os.path.getmtime(meta) == stamp  # reused, not rebuilt
    with open(corpus, "a") as f:
        f.write(json.dumps({"id": "1", "contents": '"Velmoria"\nVelmoria is a country.'}) + "\n")
    index = load_bm25(str(corpus))
    assert [d["id"] for d in bm25_search(index, ["Velmoria"], 3)[0]] == ["1"]


def test_access_returns_the_whole_page_by_title_url_or_passage_id(index):
    doc = bm25_search(index, ["founded"], 1)[0][0]
    page = access_page(index.corpus, title=doc["title"].upper())
    assert page["title"] == doc["title"] and doc["text"] in page["text"]
    assert page["contents"] == f'"{page["title"]}"\n{page["text"]}'
    wikipedia_url = "https://en.wikipedia.org/wiki/" + doc["title"].replace(" ", "_")
    assert access_page(index.corpus, url=wikipedia_url) == page
    assert access_page(index.corpus, url=doc["url"]) == page
    assert access_page(index.corpus, id=doc["id"]) == page
    assert access_page(index.corpus, title="No Such Page") is None


# --- server ---
def test_retrieve_answers_in_search_r1_shape_without_scores(server, small):
    item = read_jsonl(small["dev"])[0]
    r = _post(server, "/retrieve", {"queries": [item["hop_queries"][0], "capital of"], "topk": 4,
                                    "return_scores": False})
    assert r.status_code == 200
    result = r.json()["result"]
    assert len(result) == 2 and all(len(docs) == 4 for docs in result)
    assert all(set(doc) == {"id", "title", "text", "contents", "url"} for docs in result for doc in docs)
    assert item["support"][0] in [doc["id"] for doc in result[0]]


def test_retrieve_with_scores_wraps_each_document_with_its_score(server):
    r = _post(server, "/retrieve", {"queries": ["born"], "topk": 3, "return_scores": True})
    hits = r.json()["result"][0]
    assert [set(h) for h in hits] == [{"document", "score"}] * 3
    assert all(isinstance(h["score"], float) for h in hits)
    assert "born" in hits[0]["document"]["text"]


def test_retrieve_without_topk_uses_search_r1s_default_of_3(server):
    assert len(_post(server, "/retrieve", {"queries": ["born"]}).json()["result"][0]) == 3


def test_access_by_title_and_by_asearcher_url_batch(server):
    doc = _post(server, "/retrieve", {"queries": ["capital"], "topk": 1}).json()["result"][0][0]
    page = _post(server, "/access", {"title": doc["title"]}).json()["result"]
    assert page["title"] == doc["title"] and doc["text"] in page["text"]
    batch = _post(server, "/access", {"urls": [doc["url"], "wiki://No_Such_Page"]}).json()["result"]
    assert batch == [page, None]


def test_access_to_an_unknown_page_is_a_404_with_a_message(server):
    r = _post(server, "/access", {"title": "No Such Page"})
    assert r.status_code == 404 and "No Such Page" in r.json()["error"]


def test_a_malformed_url_is_a_400_that_names_the_url(server):
    for url in ["wiki://[Title]", "http://[::1/x"]:  # urllib rejects both bracketed hosts
        r = _post(server, "/access", {"url": url})
        assert r.status_code == 400 and '"url"' in r.json()["error"] and url in r.json()["error"], (url, r.text)


def test_a_malformed_url_in_a_batch_is_null_like_a_missing_page(server):
    doc = _post(server, "/retrieve", {"queries": ["capital"], "topk": 1}).json()["result"][0][0]
    r = _post(server, "/access", {"urls": ["wiki://[Title]", doc["url"], "http://[::1/x"]})
    assert r.status_code == 200
    assert [page and page["title"] for page in r.json()["result"]] == [None, doc["title"], None]


def test_url_batch_is_capped_in_entry_length_and_entry_count(server):
    r = _post(server, "/access", {"urls": ["wiki://Title", "wiki://" + "a" * 3_000_000]})  # 3 MB: under the body cap
    assert r.status_code == 413 and '"urls"[1]' in r.json()["error"] and "at most 2000" in r.json()["error"]
    r = _post(server, "/access", {"urls": ["wiki://Title"] * 513})
    assert r.status_code == 413 and "at most 512" in r.json()["error"]


def _post_raw(server, path, raw, headers=()):
    return requests.post(server.address + path, data=raw, timeout=TIMEOUT_S,
                         headers={"Content-Type": "application/json", **dict(headers)})


def test_json_nested_deeper_than_the_parser_goes_is_a_400(server):
    for raw in [b"[" * 1000 + b"]" * 1000, b'{"queries": ["q"], "topk": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"]:
        for path in ["/retrieve", "/access"]:
            r = _post_raw(server, path, raw)
            assert r.status_code == 400 and "nest" in r.json()["error"], (path, len(raw), r.text[:200])


def test_an_integer_literal_over_4300_digits_is_a_400_that_names_the_limit(server):
    for path, raw in [("/retrieve", b'{"queries": ["q"], "topk": ' + b"9" * 5000 + b"}"),
                      ("/access", b'{"id": ' + b"1" * 5000 + b"}")]:
        r = _post_raw(server, path, raw)
        assert r.status_code == 400 and "4300 digits" in r.json()["error"], (path, r.text[:200])


def test_a_body_that_is_not_in_its_content_encoding_is_a_400(server):
    import gzip

    body = json.dumps({"queries": ["born"], "topk": 1}).encode()
    for encoding in ["gzip", "deflate"]:
        r = _post_raw(server, "/retrieve", body, {"Content-Encoding": encoding})
        assert r.status_code == 400 and "Content-Encoding" in r.json()["error"], (encoding, r.text[:200])
    r = _post_raw(server, "/retrieve", gzip.compress(body), {"Content-Encoding": "gzip"})
    assert r.status_code == 200 and len(r.json()["result"][0]) == 1  # real gzip is read


def _exchange(index, *parts: bytes, body_timeout_s: float = 0.5) -> bytes:
    """Send `parts` over one connection to an in-process server, 0.2 s apart; all it answers until it
    closes the connection."""
    from aiohttp.test_utils import TestServer

    async def run():
        test_server = TestServer(build_app(index, body_timeout_s=body_timeout_s))
        # lingering_time: how long aiohttp still reads a body after answering (10 s by default)
        await test_server.start_server(lingering_time=0.5)
        try:
            reader, writer = await asyncio.open_connection(test_server.host, test_server.port)
            for part in parts:
                writer.write(part)
                await writer.drain()
                await asyncio.sleep(0.2)
            answer = await asyncio.wait_for(reader.read(), TIMEOUT_S)  # returns when the server closes
            writer.close()
            return answer
        finally:
            await test_server.close()

    return asyncio.run(run())


def test_a_body_not_all_sent_within_the_body_timeout_gets_a_408_and_its_connection_is_closed(index):
    answer = _exchange(index, b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b'Content-Length: 100\r\n\r\n{"queries": [')  # 13 of 100 bytes, then silence
    assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout-s" in answer, answer[:300]


def test_a_cut_short_deflate_body_sent_after_its_headers_gets_a_4xx_not_a_hang(index):
    # aiohttp never ends such a payload (it raises while closing the deflate stream): only the body timeout ends it
    answer = _exchange(index, b"POST /access HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Encoding: deflate\r\nContent-Length: 2\r\n\r\n", b"x\x9c")  # a zlib header only
    assert answer.startswith((b"HTTP/1.1 400", b"HTTP/1.1 408")), answer[:300]


def _bad_requests():
    """100 malformed or oversized requests: (method, path, raw body bytes)."""
    def body(obj):
        return json.dumps(obj).encode()

    kinds = [
        lambda i: ("POST", "/retrieve", b"{not json" + str(i).encode()),
        lambda i: ("POST", "/retrieve", b""),
        lambda i: ("POST", "/retrieve", b"\xff\xfe" + bytes([i % 256])),
        lambda i: ("POST", "/retrieve", body([f"query {i}"])),
        lambda i: ("POST", "/retrieve", body({"topk": 3})),
        lambda i: ("POST", "/retrieve", body({"queries": f"query {i}"})),
        lambda i: ("POST", "/retrieve", body({"queries": []})),
        lambda i: ("POST", "/retrieve", body({"queries": [i]})),
        lambda i: ("POST", "/retrieve", body({"queries": [None]})),
        lambda i: ("POST", "/retrieve", body({"queries": [["nested"]]})),
        lambda i: ("POST", "/retrieve", body({"queries": {"q": i}})),
        lambda i: ("POST", "/retrieve", body({"queries": ["q"] * (513 + i)})),
        lambda i: ("POST", "/retrieve", body({"queries": ["x" * (2001 + i)]})),
        lambda i: ("POST", "/retrieve", body({"queries": ["q"], "topk": 0})),
        lambda i: ("POST", "/retrieve", body({"queries": ["q"], "topk": -i})),
        lambda i: ("POST", "/retrieve", body({"queries": ["q"], "topk": 51 + i})),
        lambda i: ("POST", "/retrieve", body({"queries": ["q"], "topk": "3"})),
        lambda i: ("POST", "/retrieve", body({"queries": ["q"], "topk": 2.5})),
        lambda i: ("POST", "/retrieve", body({"queries": ["q"], "topk": True})),
        lambda i: ("POST", "/retrieve", body({"queries": ["q"], "return_scores": "yes"})),
        lambda i: ("POST", "/retrieve", b'{"queries": ["' + b"y" * (5 * 2**20) + b'"]}'),
        lambda i: ("GET", "/retrieve", b""),
        lambda i: ("POST", f"/search{i}", body({"queries": ["q"]})),
        lambda i: ("POST", "/access", body({})),
        lambda i: ("POST", "/access", body({"title": "a", "id": str(i)})),
        lambda i: ("POST", "/access", body({"title": i})),
        lambda i: ("POST", "/access", body({"urls": f"wiki://{i}"})),
        lambda i: ("POST", "/access", body({"title": f"No Such Page {i}"})),
        lambda i: ("POST", "/access", body({"id": f"missing-{i}"})),
        lambda i: ("POST", "/access", body(["title"])),
    ]
    return [kinds[i % len(kinds)](i) for i in range(100)]


def test_malformed_and_oversized_requests_get_a_4xx_json_error_and_the_server_lives_on(server):
    with requests.Session() as session:
        for method, path, raw in _bad_requests():
            r = session.request(method, server.address + path, data=raw, timeout=TIMEOUT_S,
                                headers={"Content-Type": "application/json"})
            assert 400 <= r.status_code < 500, (method, path, raw[:80], r.status_code)
            assert isinstance(r.json()["error"], str) and r.json()["error"], (path, raw[:80])
    assert requests.get(server.address + "/health", timeout=TIMEOUT_S).json()["status"] == "ok"
    assert len(_post(server, "/retrieve", {"queries": ["born"], "topk": 2}).json()["result"][0]) == 2


def test_unknown_fields_are_ignored(server):
    r = _post(server, "/retrieve", {"queries": ["born"], "topk": 1, "request_id": "abc"})
    assert r.status_code == 200 and len(r.json()["result"][0]) == 1


@pytest.mark.slow
def test_1000_concurrent_requests_are_all_answered(server, small):
    queries = [q for item in read_jsonl(small["train"]) for q in item["hop_queries"]]

    async def run():
        connector = aiohttp.TCPConnector(limit=1000)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as s:
            async def one(i):
                body = {"queries": [queries[i % len(queries)]], "topk": 3, "return_scores": i % 2 == 0}
                async with s.post(server.address + "/retrieve", json=body) as r:
                    return r.status, (await r.json())["result"]
            return await asyncio.gather(*(one(i) for i in range(1000)))

    start_s = time.perf_counter()
    answers = asyncio.run(run())
    print(f"1000 concurrent requests answered in {time.perf_counter() - start_s:.1f} s")
    assert [status for status, _ in answers] == [200] * 1000
    assert all(len(result) == 1 and len(result[0]) == 3 for _, result in answers)


def test_a_search_past_the_request_timeout_gets_a_503(index):
    from aiohttp.test_utils import TestClient, TestServer

    async def run():
        app = build_app(index, request_timeout_s=1e-6)
        async with TestClient(TestServer(app)) as client:
            r = await client.post("/retrieve", json={"queries": ["born"] * 512, "topk": 50})
            return r.status, await r.json()

    status, body = asyncio.run(run())
    assert status == 503 and "--request-timeout-s" in body["error"]


def test_partial_header_connections_past_the_fd_limit_are_closed_and_a_query_answers_with_a_small_log(
        small, index, tmp_path):
    # 160 connections that send half a request head and go silent, to a server allowed 128 file
    # descriptors: it runs out of them, and answers again once its idle timeout (1 s) closes them.
    log_path = tmp_path / "retrieval.log"
    port = free_port()
    command = ["bash", "-c", 'ulimit -n 128 && exec "$0" "$@"', sys.executable, "-m", "lib.retrieval",
               "--corpus", small["corpus"], "--port", str(port), "--idle-timeout-s", "1"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    address = f"http://127.0.0.1:{port}"
    silent = []
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(requests.ConnectionError):
                if requests.get(address + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        start_s = time.monotonic()
        for _ in range(160):
            with contextlib.suppress(OSError):
                silent.append(socket.create_connection(("127.0.0.1", port), timeout=2))
                silent[-1].sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\n")
        r = requests.post(address + "/retrieve", json={"queries": ["born"], "topk": 1}, timeout=TIMEOUT_S)
        answered_s = time.monotonic() - start_s
        assert r.status_code == 200 and len(r.json()["result"][0]) == 1
        assert answered_s < 5, f"a query waited {answered_s:.1f} s"
        silent[0].settimeout(5)
        assert silent[0].recv(100) == b""  # closed by the server, which sent nothing
        time.sleep(1)
        log = log_path.read_text()
        print(f"a query beside 160 half-sent request heads answered in {answered_s:.1f} s; {len(log)} characters of log")
        assert "out of file descriptors" in log and len(log) < 5000, f"{len(log)} characters of log:\n{log[:1500]}"
    finally:
        for s in silent:
            s.close()
        process.terminate()
        process.wait()


# --- launcher ---
def test_server_binds_loopback_unless_told_otherwise(server):
    assert parse_args(["--corpus", "c.jsonl"]).host == "127.0.0.1"
    assert server.address.startswith("http://127.0.0.1:")


def test_terminate_stops_the_server(small, tmp_path):
    handle = launch_retrieval_server(small["corpus"], log_path=str(tmp_path / "log"))
    port = int(handle.address.rsplit(":", 1)[1])
    handle.terminate()
    assert handle.process.poll() is not None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_the_server_dies_when_the_launching_process_is_killed(small, tmp_path):
    launcher = (f"import sys; sys.path.insert(0, {REPO!r}); from lib.retrieval import launch_retrieval_server; "
                f"s = launch_retrieval_server({small['corpus']!r}); print(s.process.pid, flush=True); "
                "import time; time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    server_pid = int(parent.stdout.readline())
    parent.kill()  # SIGKILL: no atexit, no cleanup in the parent
    parent.wait()
    deadline = time.monotonic() + 20
    while os.path.exists(f"/proc/{server_pid}") and time.monotonic() < deadline:
        with open(f"/proc/{server_pid}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":  # exited, waiting to be reaped by init
                break
        time.sleep(0.1)
    else:
        assert not os.path.exists(f"/proc/{server_pid}")


def test_a_server_that_fails_to_start_raises_with_its_log(tmp_path):
    corpus = tmp_path / "bad.jsonl"
    _write_corpus(corpus, [{"id": "0", "body": "no contents field"}])
    with pytest.raises(RuntimeError, match="neither 'contents' nor 'text'"):
        launch_retrieval_server(str(corpus), timeout_s=60)


def test_dense_retriever_without_its_packages_names_the_install_command(tmp_path):
    import importlib.util

    if importlib.util.find_spec("faiss") and importlib.util.find_spec("sentence_transformers"):
        pytest.skip("dense packages are installed here")
    from lib.retrieval import load_dense

    with pytest.raises(ImportError, match="pip install sentence-transformers faiss"):
        load_dense(str(tmp_path / "c.jsonl"))
