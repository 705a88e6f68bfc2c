"""Retrieval server speaking the Search-R1 / ASearcher HTTP API, its launcher, and in-process BM25.

    python -m lib.retrieval --corpus corpus.jsonl --port 5001 [--retriever bm25|dense]

`POST /retrieve {"queries": [...], "topk": 3, "return_scores": false}` answers
`{"result": [[doc, ...] per query]}`, with `return_scores` each item is `{"document": doc,
"score": s}` (Search-R1's `retrieval_server.py` shape). A doc is `{"id", "title", "text",
"contents", "url"}`: Search-R1's agent reads `contents` ('"Title"\\ntext'), ASearcher's reads
`contents` and `url`. Like Search-R1's BM25 (pyserini), a query gets only the passages that share
a term with it, so it may get fewer than `topk`.
`POST /access {"title"|"url"|"id": ...}` answers `{"result": page}` or a 404; a page joins the
passages that share a title (wiki-18 splits articles into such passages). `{"urls": [...]}`
(ASearcher's client) answers `{"result": [page or null, ...]}`. `GET /health`.
Errors are 4xx/5xx with `{"error": "message"}`. Docs: docs/retrieval.md.
"""
import argparse
import asyncio
import concurrent.futures
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from lib.cache import cache_root
from lib.http_body import BadRequest, errors_as_json, read_json_body

# bm25s imports jax when it is installed, and jax on a GPU machine takes 75% of every GPU's memory at
# start-up, which leaves an inference server on that GPU out of memory. BM25 needs no GPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

logger = logging.getLogger("retrieval")

# Bump when the cached index layout or tokenization changes, so old caches are rebuilt.
INDEX_FORMAT_VERSION = 1
STOPWORDS = "en"
DEFAULT_TOPK = 3  # Search-R1's default when a request has no topk


# --- corpus ---
@dataclass
class Corpus:
    ids: list[str]
    contents: list[str]  # '"Title"\ntext' per passage, as in Search-R1's wiki-18 jsonl
    # normalised title -> rows, and id -> row; built on the first /access (costly on wiki-18)
    _pages: dict | None = field(default=None, repr=False)
    _rows: dict | None = field(default=None, repr=False)


def read_corpus(corpus_path: str) -> Corpus:
    """Read a jsonl corpus: `{"id", "contents"}` per line (Search-R1), or `{"id", "title", "text"}`."""
    ids, contents = [], []
    with open(corpus_path, encoding="utf-8") as f:
        for line_no, line in enumerate(f):
            if not line.strip():
                continue
            row = json.loads(line)
            if "contents" in row:
                text = row["contents"]
            elif "text" in row:
                text = f'"{row.get("title", "")}"\n{row["text"]}'
            else:
                raise ValueError(f"{corpus_path}:{line_no + 1} has neither 'contents' nor 'text'; each line must be "
                                 '{"id": ..., "contents": "\\"Title\\"\\ntext"}')
            ids.append(str(row.get("id", len(ids))))
            contents.append(text)
    if not ids:
        raise ValueError(f"{corpus_path} holds no passages")
    return Corpus(ids, contents)


def split_contents(contents: str) -> tuple[str, str]:
    title, _, text = contents.partition("\n")
    return title.strip().strip('"'), text


def page_url(title: str) -> str:
    return "wiki://" + urllib.parse.quote(title.replace(" ", "_"))


def make_doc(corpus: Corpus, row: int) -> dict:
    title, text = split_contents(corpus.contents[row])
    return {"id": corpus.ids[row], "title": title, "text": text, "contents": corpus.contents[row],
            "url": page_url(title)}


def _normalise_title(title: str) -> str:
    return " ".join(title.replace("_", " ").strip().strip('"').casefold().split())


def _build_lookup(corpus: Corpus):
    pages, rows = {}, {}
    for row, (pid, contents) in enumerate(zip(corpus.ids, corpus.contents)):
        pages.setdefault(_normalise_title(split_contents(contents)[0]), []).append(row)
        rows.setdefault(pid, row)
    corpus._pages, corpus._rows = pages, rows


def _title_from_url(url: str) -> str:
    """The title in wiki://Title, https://en.wikipedia.org/wiki/Title or index.php?title=Title.
    ValueError for a url that does not parse (urllib rejects a bad bracketed host: `wiki://[Title]`)."""
    parsed = urllib.parse.urlparse(url.strip())
    query_title = urllib.parse.parse_qs(parsed.query).get("title")
    if query_title:
        return query_title[0]
    tail = (parsed.netloc + parsed.path) if parsed.scheme == "wiki" else parsed.path
    return urllib.parse.unquote(tail.rstrip("/").rsplit("/", 1)[-1] if "/" in tail else tail)


def access_page(corpus: Corpus, id: str | None = None, url: str | None = None,
                title: str | None = None) -> dict | None:
    """The page (all passages with one title, in corpus order) of a passage id, a url or a title;
    titles match ignoring case, quotes, underscores and extra spaces. None when there is none (also
    for a url that does not parse)."""
    if corpus._rows is None:  # _rows is assigned last, so a concurrent caller never sees half a lookup
        _build_lookup(corpus)
    if id is not None:
        row = corpus._rows.get(str(id))
        if row is None:
            return None
        title = split_contents(corpus.contents[row])[0]
    elif url is not None:
        try:
            title = _title_from_url(url)
        except ValueError:  # a url that does not parse names no page
            return None
    rows = corpus._pages.get(_normalise_title(title or ""))
    if not rows:
        return None
    page_title = split_contents(corpus.contents[rows[0]])[0]
    text = " ".join(split_contents(corpus.contents[r])[1] for r in rows)
    return {"id": corpus.ids[rows[0]], "title": page_title, "text": text, "contents": f'"{page_title}"\n{text}',
            "url": page_url(page_title)}


# --- BM25 ---
@dataclass
class Bm25Index:
    corpus: Corpus
    retriever: object  # bm25s.BM25


def _corpus_key(corpus_path: str) -> dict:
    import bm25s

    st = os.stat(corpus_path)
    return {"format": INDEX_FORMAT_VERSION, "bm25s": bm25s.__version__, "stopwords": STOPWORDS,
            "corpus_bytes": st.st_size, "corpus_mtime_ns": st.st_mtime_ns}


def default_index_dir(corpus_path: str) -> str:
    """`<corpus>.bm25s/` next to the corpus, or under $AGENTRL_CACHE when that folder is read-only."""
    beside = os.path.abspath(corpus_path) + ".bm25s"
    if os.access(os.path.dirname(beside), os.W_OK):
        return beside
    import hashlib

    digest = hashlib.sha1(os.path.abspath(corpus_path).encode()).hexdigest()[:12]
    return os.path.join(cache_root(), "bm25s", f"{os.path.basename(corpus_path)}-{digest}")


def load_bm25(corpus_path: str, index_dir: str | None = None) -> Bm25Index:
    """The corpus and its BM25 index, built on first use and cached in `index_dir` (default
    `<corpus>.bm25s/`); rebuilt when the corpus file's size or mtime changes."""
    import bm25s

    corpus = read_corpus(corpus_path)
    index_dir = index_dir or default_index_dir(corpus_path)
    key = _corpus_key(corpus_path)
    meta_path = os.path.join(index_dir, "agentrl_meta.json")
    try:
        with open(meta_path) as f:
            cached = json.load(f) == key
    except (OSError, ValueError):
        cached = False
    if cached:
        retriever = bm25s.BM25.load(index_dir, show_progress=False)
        if retriever.scores["num_docs"] == len(corpus.ids):
            return Bm25Index(corpus, retriever)
    start_s = time.perf_counter()
    tokens = bm25s.tokenize(corpus.contents, stopwords=STOPWORDS, show_progress=False)
    retriever = bm25s.BM25()
    retriever.index(tokens, show_progress=False)
    # Written beside, then swapped in, so a killed build never leaves an index that looks valid.
    parent = os.path.dirname(os.path.abspath(index_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-bm25s-")
    try:
        retriever.save(tmp, show_progress=False)
        with open(os.path.join(tmp, "agentrl_meta.json"), "w") as f:
            json.dump(key, f)
        old = None
        if os.path.exists(index_dir):
            old = tempfile.mkdtemp(dir=parent, prefix=".old-bm25s-")
            os.rename(index_dir, os.path.join(old, "index"))
        os.rename(tmp, index_dir)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        logger.warning("could not cache the BM25 index in %s (%s); it will be rebuilt next time", index_dir, e)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built BM25 index of %d passages in %.1f s", len(corpus.ids), time.perf_counter() - start_s)
    return Bm25Index(corpus, retriever)


def _top_rows(scores, k: int):
    """Rows of the k best positive scores, best first, ties by lower row. Not bm25s' own top-k:
    numpy's argpartition crawls on the many tied scores of short passages (3 ms at 20k passages,
    170 ms at 1M). The k-th largest of the block maxima bounds the k-th largest score from below,
    so one cheap pass leaves a handful of candidates to sort."""
    import numpy as np

    block = max(1, int(len(scores) ** 0.5))
    maxima = np.maximum.reduceat(scores, np.arange(0, len(scores), block))
    bound = np.partition(maxima, len(maxima) - k)[len(maxima) - k] if len(maxima) > k else 0.0
    rows = np.flatnonzero(scores >= bound) if bound > 0 else np.flatnonzero(scores > 0)
    best = np.lexsort((rows, -scores[rows]))[:k]
    return rows[best].tolist(), scores[rows[best]].tolist()


def bm25_search(index: Bm25Index, queries: list[str], topk: int, return_scores: bool = False) -> list[list[dict]]:
    """Top-`topk` docs per query, best first; with `return_scores`, `{"document", "score"}` items.
    Only passages sharing a term with the query are returned."""
    import bm25s

    retriever = index.retriever
    out = []
    for query_tokens in bm25s.tokenize(queries, stopwords=STOPWORDS, return_ids=False, show_progress=False):
        ids = retriever.get_tokens_ids(query_tokens)
        rows, scores = _top_rows(retriever.get_scores_from_ids(ids), topk) if ids else ([], [])
        if return_scores:
            out.append([{"document": make_doc(index.corpus, r), "score": s} for r, s in zip(rows, scores)])
        else:
            out.append([make_doc(index.corpus, r) for r in rows])
    return out


# --- dense (e5 + faiss), optional ---
@dataclass
class DenseIndex:
    corpus: Corpus
    encoder: object  # sentence_transformers.SentenceTransformer
    faiss_index: object


def _import_dense():
    try:
        import faiss
        import sentence_transformers
    except ImportError as e:
        raise ImportError(f"--retriever dense needs sentence-transformers and faiss ({e}); install them with "
                          "`pip install sentence-transformers faiss-cpu` (or faiss-gpu), or use --retriever bm25") from e
    return faiss, sentence_transformers


def load_dense(corpus_path: str, model_name: str = "intfloat/e5-base-v2", faiss_index_path: str | None = None,
               device: str | None = None, batch_size: int = 256) -> DenseIndex:
    """e5 embeddings with an inner-product faiss index: `faiss_index_path` if it exists (e.g.
    Search-R1's wiki-18 `e5_Flat.index`, rows in corpus order), else built by encoding the corpus
    and saved there (default `<corpus>.<model>.faiss`)."""
    faiss, sentence_transformers = _import_dense()
    corpus = read_corpus(corpus_path)
    encoder = sentence_transformers.SentenceTransformer(model_name, device=device)
    path = faiss_index_path or f"{os.path.abspath(corpus_path)}.{os.path.basename(model_name.rstrip('/'))}.faiss"
    if os.path.exists(path):
        faiss_index = faiss.read_index(path)
    else:
        passages = [f"passage: {c}" for c in corpus.contents]  # e5 was trained with these prefixes
        emb = encoder.encode(passages, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True,
                             show_progress_bar=True)
        faiss_index = faiss.IndexFlatIP(emb.shape[1])
        faiss_index.add(emb.astype("float32"))
        faiss.write_index(faiss_index, path)
    if faiss_index.ntotal != len(corpus.ids):
        raise ValueError(f"{path} holds {faiss_index.ntotal} vectors but {corpus_path} has {len(corpus.ids)} "
                         "passages; point --dense-index at the index built from this corpus")
    return DenseIndex(corpus, encoder, faiss_index)


def dense_search(index: DenseIndex, queries: list[str], topk: int, return_scores: bool = False) -> list[list[dict]]:
    emb = index.encoder.encode([f"query: {q}" for q in queries], normalize_embeddings=True, convert_to_numpy=True)
    scores, rows = index.faiss_index.search(emb.astype("float32"), min(topk, len(index.corpus.ids)))
    out = []
    for query_rows, query_scores in zip(rows.tolist(), scores.tolist()):
        hits = [(r, s) for r, s in zip(query_rows, query_scores) if r >= 0]
        if return_scores:
            out.append([{"document": make_doc(index.corpus, r), "score": s} for r, s in hits])
        else:
            out.append([make_doc(index.corpus, r) for r, _ in hits])
    return out


def search(index, queries: list[str], topk: int, return_scores: bool = False) -> list[list[dict]]:
    if isinstance(index, DenseIndex):
        return dense_search(index, queries, topk, return_scores)
    return bm25_search(index, queries, topk, return_scores)


# --- HTTP server ---
def _json_type(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _preview(value, max_chars: int = 50) -> str:
    """A client's value for an error message: a scalar as JSON, cut to `max_chars`; an array or object
    by its type only, since rendering one costs as much as the body (and recurses as deep as it nests)."""
    if isinstance(value, (dict, list)):
        return _json_type(value)
    return json.dumps(value)[:max_chars]


def _check_strings(values, name: str, max_items: int, max_chars: int):
    """BadRequest unless `values` is a list of at most `max_items` strings of at most `max_chars` each."""
    if not isinstance(values, list):
        raise BadRequest(f'"{name}" must be a list of strings, got {_json_type(values)}')
    if len(values) > max_items:
        raise BadRequest(f'"{name}" holds {len(values)} entries; at most {max_items} per request '
                         "(split the batch or raise the server's --max-batch)", 413)
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise BadRequest(f'"{name}"[{i}] is {_json_type(value)}, not a string')
        if len(value) > max_chars:
            raise BadRequest(f'"{name}"[{i}] has {len(value)} characters; at most {max_chars} '
                             "(shorten it or raise the server's --max-query-chars)", 413)


def _check_url(url: str):
    try:
        _title_from_url(url)
    except ValueError as e:
        raise BadRequest(f'"url" {_preview(url)} is not a valid URL ({e}); use a url from the search results, '
                         'like "wiki://Title"')


def parse_retrieve(body, max_batch: int, max_query_chars: int, topk_max: int) -> tuple[list[str], int, bool]:
    """(queries, topk, return_scores) of a /retrieve body, or BadRequest naming the problem.
    Unknown fields are ignored, as Search-R1's server does."""
    if not isinstance(body, dict):
        raise BadRequest('the body must be a JSON object like {"queries": ["..."], "topk": 3}')
    queries = body.get("queries")
    if isinstance(queries, str):
        raise BadRequest('"queries" must be a list of strings; wrap a single query in a list')
    if not isinstance(queries, list) or not queries:
        raise BadRequest('"queries" must be a non-empty list of strings')
    _check_strings(queries, "queries", max_batch, max_query_chars)
    topk = body.get("topk")
    if topk is None:
        topk = DEFAULT_TOPK
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise BadRequest(f'"topk" must be an integer in [1, {topk_max}], got {_preview(topk)}')
    if not 1 <= topk <= topk_max:
        raise BadRequest(f'"topk" must be in [1, {topk_max}], got {_preview(topk)} '
                         "(raise the server's --topk-max for more)")
    return_scores = body.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise BadRequest(f'"return_scores" must be true or false, got {_preview(return_scores)}')
    return queries, topk, return_scores


def _log_accept_errors_rate_limited(interval_s: float = 10.0):
    """An event-loop exception handler that reports a failed accept() (the process is out of file
    descriptors) in one line per `interval_s`: asyncio logs a traceback for every attempt, thousands
    a second (hundreds of MB of log in minutes). Anything else goes to asyncio's own handler."""
    last_s, missed = -math.inf, 0

    def handler(loop, context):
        nonlocal last_s, missed
        if context.get("message") != "socket.accept() out of system resource":
            loop.default_exception_handler(context)
            return
        if time.monotonic() - last_s < interval_s:
            missed += 1
            return
        logger.error("cannot accept connections, out of file descriptors (%s; %d more failed accepts since the "
                     "last report): idle connections are closed after --idle-timeout-s; raise `ulimit -n` if this "
                     "persists", context.get("exception"), missed)
        last_s, missed = time.monotonic(), 0
    return handler


def _error(status: int, message: str):
    from aiohttp import web

    return web.json_response({"error": message}, status=status)


def build_app(index, topk_max: int = 50, max_batch: int = 512, max_query_chars: int = 2000,
              request_timeout_s: float = 60.0, num_workers: int = 2, max_body_bytes: int = 4 * 2**20,
              body_timeout_s: float = 10.0):
    """The aiohttp app over a loaded index. Searches run in a thread pool so the loop keeps
    answering (health checks, bad requests) while one runs."""
    from aiohttp import web

    pool = concurrent.futures.ThreadPoolExecutor(num_workers, thread_name_prefix="retrieval")
    kind = "dense" if isinstance(index, DenseIndex) else "bm25"

    async def run_in_pool(fn, *args):
        try:
            return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(pool, fn, *args),
                                          request_timeout_s)
        except asyncio.TimeoutError:
            raise BadRequest(f"the search took longer than {request_timeout_s} s; send smaller batches or "
                             "raise the server's --request-timeout-s", 503)

    async def retrieve(request):
        body = await read_json_body(request, max_body_bytes=max_body_bytes, timeout_s=body_timeout_s,
                                    too_large_hint="send fewer or shorter queries")
        queries, topk, return_scores = parse_retrieve(body, max_batch, max_query_chars, topk_max)
        result = await run_in_pool(search, index, queries, topk, return_scores)
        return web.json_response({"result": result})

    async def access(request):
        body = await read_json_body(request, max_body_bytes=max_body_bytes, timeout_s=body_timeout_s,
                                    too_large_hint="send fewer or shorter queries")
        if not isinstance(body, dict):
            raise BadRequest('the body must be a JSON object like {"title": "..."}, {"url": "..."}, {"id": "..."} '
                             'or {"urls": [...]}')
        if "urls" in body:
            # ASearcher's client: a batch, null for a page not found. A url that does not parse names no
            # page either, so it is a null too: one bad url must not cost the others their pages.
            urls = body["urls"]
            _check_strings(urls, "urls", max_batch, max_query_chars)
            pages = await run_in_pool(lambda: [access_page(index.corpus, url=u) for u in urls])
            return web.json_response({"result": pages})
        keys = [k for k in ("id", "url", "title") if k in body]
        if len(keys) != 1:
            raise BadRequest('give exactly one of "id", "url" or "title" (or "urls": [...])')
        key, value = keys[0], body[keys[0]]
        if not isinstance(value, str) and not (key == "id" and isinstance(value, int) and not isinstance(value, bool)):
            raise BadRequest(f'"{key}" must be a string, got {_json_type(value)}')
        if isinstance(value, str) and len(value) > max_query_chars:
            raise BadRequest(f'"{key}" has {len(value)} characters; at most {max_query_chars}', 413)
        if key == "url":
            _check_url(value)
        page = await run_in_pool(lambda: access_page(index.corpus, **{key: value}))
        if page is None:
            return _error(404, f"no page with {key} {_preview(value)}; search first and use a title "
                               "or url from the results")
        return web.json_response({"result": page})

    async def health(request):
        return web.json_response({"status": "ok", "retriever": kind, "num_passages": len(index.corpus.ids)})

    async def on_startup(app):
        asyncio.get_running_loop().set_exception_handler(_log_accept_errors_rate_limited())

    async def on_cleanup(app):
        pool.shutdown(wait=False, cancel_futures=True)

    routes = "the endpoints are POST /retrieve, POST /access, GET /health"
    app = web.Application(client_max_size=max_body_bytes, middlewares=[errors_as_json(_error, logger, routes)])
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/retrieve", retrieve)
    app.router.add_post("/access", access)
    app.router.add_get("/health", health)
    return app


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Search-R1/ASearcher-compatible retrieval server (BM25 or e5 + faiss).")
    p.add_argument("--corpus", required=True, help='jsonl with {"id", "contents": "\\"Title\\"\\ntext"} per line')
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to serve other machines")
    p.add_argument("--port", type=int, default=5001)
    p.add_argument("--retriever", choices=["bm25", "dense"], default="bm25")
    p.add_argument("--index-dir", default=None, help="BM25 index cache (default <corpus>.bm25s/)")
    p.add_argument("--dense-model", default="intfloat/e5-base-v2")
    p.add_argument("--dense-index", default=None, help="faiss index file (e.g. Search-R1's e5_Flat.index)")
    p.add_argument("--device", default=None, help="dense encoder device (cuda, cpu); default: sentence-transformers' choice")
    p.add_argument("--topk-max", type=int, default=50)
    p.add_argument("--max-batch", type=int, default=512, help="queries per request at most")
    p.add_argument("--max-query-chars", type=int, default=2000)
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--body-timeout-s", type=float, default=10.0,
                   help="a request body not all received within this gets a 408 and its connection is closed")
    p.add_argument("--idle-timeout-s", type=float, default=20.0,
                   help="a connection that has not sent a whole request head this long after it opened (or after "
                        "its last answer) is closed; keep it above clients' keep-alive (aiohttp's: 15 s)")
    p.add_argument("--num-workers", type=int, default=2, help="search threads")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def main(argv=None):
    from aiohttp import web

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    start_s = time.perf_counter()
    if args.retriever == "dense":
        index = load_dense(args.corpus, args.dense_model, args.dense_index, args.device)
    else:
        index = load_bm25(args.corpus, args.index_dir)
    search(index, ["warm up"], 1)  # imports and first-call costs land here, not on the first request
    logger.info("loaded %d passages (%s) in %.1f s; serving on http://%s:%d", len(index.corpus.ids), args.retriever,
                time.perf_counter() - start_s, args.host, args.port)
    app = build_app(index, args.topk_max, args.max_batch, args.max_query_chars, args.request_timeout_s,
                    args.num_workers, body_timeout_s=args.body_timeout_s)
    # keepalive_timeout is aiohttp's header timeout too: it closes a connection that has sent no whole
    # request head since it opened (or since its last answer). With its default (75 s), a few hundred
    # half-sent heads hold every file descriptor and shut out all queries for over a minute.
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, keepalive_timeout=args.idle_timeout_s)


# --- launcher ---

def launch_retrieval_server(corpus_path: str, host: str = "127.0.0.1", port: int | None = None,
                            timeout_s: float = 120.0, log_path: str | None = None,
                            extra_args: tuple[str, ...] = ()):
    """Start `python -m lib.retrieval` and wait for /health; a `lib.launch.ServerProcess`, which dies
    with this process as the inference servers do (lib/launch.py)."""
    if not os.path.exists(corpus_path):
        raise FileNotFoundError(f"corpus {corpus_path} not found; build one with lib.wiki_data.build_wiki_data "
                                "or point at a Search-R1 jsonl corpus")
    from lib.launch import free_port, launch_server_process, lib_importable_env  # the server itself needs neither

    port = port or free_port(host)
    cmd = [sys.executable, "-m", "lib.retrieval", "--corpus", os.path.abspath(corpus_path), "--host", host,
           "--port", str(port), *extra_args]
    return launch_server_process(cmd, host=host, port=port, log_path=log_path, timeout_s=timeout_s,
                                 env=lib_importable_env(), name="retrieval", wait=_wait_for_health,
                                 hint="a large corpus takes longer to index: raise timeout_s")


def _wait_for_health(address: str, timeout_s: float, *, process: subprocess.Popen, log_path: str) -> None:
    from lib.launch import log_tail

    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"retrieval server exited with code {process.returncode} before answering /health; "
                               f"last log lines ({log_path}):\n{log_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"{address}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"retrieval server at {address} did not answer /health within {timeout_s} s; "
                               f"last log lines ({log_path}):\n{log_tail(log_path)}")
        time.sleep(0.2)


if __name__ == "__main__":
    main()
