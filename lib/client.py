"""Async client for SGLang's native HTTP API (and lib.cpu_server, which speaks the same subset).

Token ids in, token ids and the server's per-token log-probs out (`/generate` with `input_ids` and
`return_logprob`). With several servers, a trajectory is routed to the least loaded server on its
first turn and stays there (its prefix is in that server's cache). Control calls (pause, weight
updates, ...) go to every server. Field names and their sources: docs/client.md and
docs/sglang_contract.md.

One `generate()` call is one model turn, whatever number of requests it takes: pieces cut by
`piece_tokens` are continued, and stop strings, stop token ids and the length limit are applied to
the whole turn by the client (a server sees only its own piece).

Pause handling, for async RL: `pause_generation()` (mode "abort", SGLang's default) makes every
server answer its in-flight requests with finish_reason abort and their partial output. A
`generate()` call that gets such an answer while the client is paused waits for
`continue_generation()` and then re-sends prompt + output so far for the remaining tokens; the
tokens of each piece are tagged in `Generation.versions` with the client's policy version when that
piece was sent, so the trainer knows which tokens came from which weights. Any other abort raises
`GenerationAborted`.

Prefix cache and weight updates: every request carries SGLang's `extra_key` = "policy-v<version>",
the client's policy version when it is sent. SGLang's radix cache keeps keys apart, so a request
reuses only prefixes computed under the weights it is sampled with: a prompt cached under old
weights is never reused after a weight update (measured on SGLang 0.5.15: without this, a prefix
cached at version 0 shaped sampling for the rest of a run; docs/client.md). What a request held
by an `in_place` pause keeps is its own KV, as old as the request (the producer's admission bound
keeps that within `max_staleness`). `version_cache_key=False` leaves the key out, for servers that
do not know it.

LoRA: once a trainer has synced an adapter (`set_lora_adapter(name)`, after `load_lora_adapter` on
every server), every request names it (SGLang's `lora_path`), the name current when the request is
sent. Names carry the policy version (lib/weight_sync.py), so a server that lacks the newest adapter
refuses the request (400) instead of sampling it from a stale one.
"""
import asyncio
import collections
import dataclasses
import functools
import hashlib
import json
import math
import uuid

import aiohttp


def request_seed(seed: int, trajectory_id, position: int) -> int:
    """SGLang's per-request `sampling_seed` (a non-negative int64) for the request of trajectory
    `trajectory_id` whose input is `position` tokens long."""
    digest = hashlib.blake2b(f"{seed}/{trajectory_id}/{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2 ** 63 - 1)


@dataclasses.dataclass
class Generation:
    output_ids: list[int]
    logprobs: list[float]  # server's log-prob of each output id, same length as output_ids
    finish_reason: str  # "stop" | "length" | "abort"
    matched: int | str | None  # the stop token id or stop string that ended it (finish_reason "stop")
    text: str  # decoded by the server, matched stop trimmed; for display only, never re-encode it
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache, summed over resumed pieces
    weight_version: str  # the server's weight_version when the last piece finished
    versions: list[int]  # per output token: client policy version when its piece was sent
    num_resumes: int = 0  # how many times a pause cut this generation and it was re-sent
    num_continuations: int = 0  # how many times a piece cut by `piece_tokens` was continued
    # per output token, with generate(top_logprobs=k): the k most likely tokens, [(logprob, token id), ...]
    top_logprobs: list | None = None


class InferenceServerError(RuntimeError):
    """A request the server refused (4xx, `success: false`) or that failed after all retries."""

    def __init__(self, message: str, *, address: str, status: int | None = None):
        super().__init__(message)
        self.address = address
        self.status = status


class GenerationAborted(InferenceServerError):
    """A server aborted a generation for a reason other than a pause (see `InferenceClient.generate`)."""


class InferenceClient:
    def __init__(self, addresses: list[str], *, max_concurrent_requests: int = 256, request_timeout_s: float = 3600.0,
                 max_retries: int = 3, retry_backoff_s: float = 1.0, connect_timeout_s: float = 30.0,
                 version_cache_key: bool = True, sampling_seed: int | None = None):
        if isinstance(addresses, str):
            addresses = [addresses]
        if not addresses:
            raise ValueError("InferenceClient needs at least one server address, e.g. ['http://127.0.0.1:30000']")
        self.addresses = [a.rstrip("/") if "://" in a else "http://" + a.rstrip("/") for a in addresses]
        self.max_concurrent_requests = max_concurrent_requests
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.version = 0
        self.lora_adapter: str | None = None  # the LoRA adapter every request names (`lora_path`), once synced
        self.version_cache_key = version_cache_key
        self.sampling_seed = sampling_seed
        self._routes: dict = {}  # trajectory_id -> address
        self._live_trajectories = {a: 0 for a in self.addresses}
        self._in_flight = {a: 0 for a in self.addresses}
        # control calls sent to a server and not answered: "POST http://host:port/path" -> how many
        # (a weight sync past its deadline names them: lib/weight_sync.py)
        self.calls_in_flight: collections.Counter = collections.Counter()
        self._paused = False
        # Bumped by every pause: an abort answer to a request sent before the latest pause began is
        # a pause-abort even if the client has been continued by the time the answer is read.
        self._pause_count = 0
        # Event-loop-bound state, created inside the loop that uses the client (see _bind_loop).
        self._loop = None
        self._session = None
        self._semaphore = None
        self._resumed = None
        self._aborts: set = set()  # /abort_request calls under way (see _abort_in_background)

    def set_version(self, version: int):
        """The policy version tagged on tokens of requests sent from now on (call after each weight sync)."""
        self.version = int(version)

    def set_lora_adapter(self, name: str | None):
        """The LoRA adapter (a name loaded on every server) that requests sent from now on are generated
        with; None = the servers' base weights."""
        self.lora_adapter = name

    # --- generation ---
    async def generate(self, input_ids: list[int], *, max_new_tokens: int, temperature: float = 1.0,
                       top_p: float = 1.0, top_k: int = -1, stop: list[str] | None = None,
                       stop_token_ids: list[int] | None = None, trajectory_id=None,
                       piece_tokens: int | None = None, extra_sampling_params: dict | None = None,
                       top_logprobs: int = 0, on_tokens=None) -> Generation:
        """Generate up to `max_new_tokens` after `input_ids`: one model turn, which ends at the first
        completed stop string, at any id of `stop_token_ids` (pass the model's whole EOS set), or at
        `max_new_tokens`, whatever each server answer's finish_reason says.

        The turn may reach the server as several requests ("pieces"): with `piece_tokens`, each
        request asks for at most that many tokens and a piece cut by it is continued; a pause
        (`pause_generation`) cuts a piece, which is re-sent after `continue_generation`. A server
        checks stops only in its own piece's output, so the client re-checks them over the whole
        turn: a stop string that straddles a cut ends the turn at the token that completes it
        (tokens, log-probs and versions cut at the same index), and so does a stop token id that a
        server reported as `length` (SGLang checks length first). Give the same `trajectory_id` for
        every turn of one episode (and call `end_trajectory` at its end) to keep it on one server.
        `extra_sampling_params` go into SGLang's sampling_params as they are (e.g. min_p).
        With the client's `sampling_seed`, each request of a trajectory is sampled with the seed
        `request_seed(sampling_seed, trajectory_id, its input length)`: a run whose trajectory ids
        are a function of its data (item index, sample) samples the same tokens again.

        `top_logprobs`: also the server's `top_logprobs` most likely tokens at each step
        (`Generation.top_logprobs`, SGLang's `top_logprobs_num`). `on_tokens(ids, logprobs, tops)`:
        the turn is streamed (SGLang's `stream: true`) and each run of new tokens is handed over as
        it arrives, with their log-probs (and top log-probs, or None); what it is handed is exactly
        the Generation's tokens, in order (a stop string ends the stream at the token completing it).

        Each request carries its own `rid`; a call that is cancelled (its caller gave up) asks the
        server to abort that request (`/abort_request`) rather than leave it generating.

        An abort that is not a pause (a server-side timeout, a failed forward, `abort_request`)
        raises `GenerationAborted`: that turn's output is not what the policy would have written,
        so it must not become training data."""
        self._bind_loop()
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if piece_tokens is not None and piece_tokens < 1:
            raise ValueError(f"piece_tokens must be >= 1 (or None), got {piece_tokens}")
        if isinstance(stop, str):
            stop = [stop]
        stop = [s for s in (stop or []) if s]
        stop_ids = {int(t) for t in (stop_token_ids or [])}
        sampling = {**(extra_sampling_params or {}), "temperature": temperature, "top_p": top_p, "top_k": top_k}
        if stop:
            sampling["stop"] = list(stop)
        if stop_ids:
            sampling["stop_token_ids"] = sorted(stop_ids)
        address = self._route(trajectory_id)
        prompt = [int(t) for t in input_ids]
        turn = _Turn(stop, on_tokens)
        cached_tokens, num_resumes, num_continuations = 0, 0, 0
        self._in_flight[address] += 1
        try:
            while True:
                remaining = max_new_tokens - len(turn.output_ids)
                asked = min(remaining, piece_tokens) if piece_tokens else remaining
                await self._acquire_send_slot()
                try:
                    version, pause_count, before = self.version, self._pause_count, len(turn.output_ids)
                    adapter = self.lora_adapter
                    body = {"input_ids": prompt + turn.output_ids, "rid": uuid.uuid4().hex,
                            "sampling_params": {**sampling, "max_new_tokens": asked},
                            "return_logprob": True,
                            # Each token's text, to find a stop string across pieces (see above).
                            "return_text_in_logprobs": bool(stop)}
                    if top_logprobs:
                        body["top_logprobs_num"] = top_logprobs
                    if adapter is not None:  # the adapter of this version; a server without it refuses (400)
                        body["lora_path"] = adapter
                    if self.version_cache_key:  # prefixes cached under other weights are not reused
                        body["extra_key"] = f"policy-v{version}"
                    if self.sampling_seed is not None and trajectory_id is not None and "sampling_seed" not in sampling:
                        body["sampling_params"]["sampling_seed"] = request_seed(
                            self.sampling_seed, trajectory_id, len(prompt) + len(turn.output_ids))
                    piece = await self._generate_piece(address, body, turn, version, stream=on_tokens is not None)
                finally:
                    self._semaphore.release()
                if top_logprobs and piece["top"] is None and piece["output_ids"]:
                    raise InferenceServerError(
                        f"/generate at {address} answered without meta_info.output_top_logprobs: this server cannot "
                        f"give the most likely tokens of each step (SGLang and lib.cpu_server can); leave "
                        f"top_logprobs at 0", address=address, status=400)
                cached_tokens += piece["cached_tokens"]
                finish_reason, matched, weight_version = piece["finish_reason"], piece["matched"], piece["weight_version"]
                turn.texts.append(piece["text"])
                paused = finish_reason == "abort" and (self._paused or self._pause_count != pause_count)
                if finish_reason == "abort" and not paused:
                    raise GenerationAborted(
                        f"/generate at {address} was aborted ({piece['abort_message'] or 'no message'}) after "
                        f"{len(turn.output_ids)} tokens, not by a pause: a server-side timeout, a failed forward or "
                        f"abort_request; the episode must be dropped, not trained on", address=address)
                # Did the turn end, whatever this piece's finish_reason says? (A pause-abort lands
                # after a token was sampled; SGLang checks length before stop tokens and strings.)
                if turn.cut is not None:
                    break
                if turn.output_ids and turn.output_ids[-1] in stop_ids:
                    finish_reason, matched = "stop", turn.output_ids[-1]
                    break
                if len(turn.output_ids) >= max_new_tokens:
                    finish_reason, matched = "length", None
                    break
                if paused:
                    num_resumes += 1
                elif finish_reason == "length" and piece_tokens and len(turn.output_ids) - before >= asked:
                    num_continuations += 1
                else:
                    break  # the server's own stop, or a length it set itself (its context length)
        finally:
            self._in_flight[address] -= 1
        text = "".join(turn.texts)
        if turn.cut is not None:
            finish_reason, matched = "stop", turn.cut
            text = "".join(turn.token_texts)
            text = text[:text.find(turn.cut)]  # trimmed, as SGLang trims its text
        return Generation(output_ids=turn.output_ids, logprobs=turn.logprobs, finish_reason=finish_reason,
                          matched=matched, text=text, prompt_tokens=len(prompt), cached_tokens=cached_tokens,
                          weight_version=weight_version, versions=turn.versions, num_resumes=num_resumes,
                          num_continuations=num_continuations, top_logprobs=turn.top if top_logprobs else None)

    async def _generate_piece(self, address: str, body: dict, turn: "_Turn", version: int, stream: bool) -> dict:
        """One /generate request of a turn: its tokens go to `turn` (as they arrive, when streamed);
        returns the piece's finish fields. A request given up (cancelled, or cut by a stop string
        in its stream) is aborted on the server by its rid."""
        rid = body["rid"]
        try:
            if not stream:
                piece = _parse_generation(await self._request("POST", address, "/generate", body), address)
                turn.add(piece, version)
                return piece
            piece = await self._stream_piece(address, {**body, "stream": True}, turn, version)
            if turn.cut is not None and piece["finish_reason"] is None:
                self._abort_in_background(address, rid)  # the stop string came before the server saw it
            return piece
        except asyncio.CancelledError:
            self._abort_in_background(address, rid)
            raise

    async def _stream_piece(self, address: str, body: dict, turn: "_Turn", version: int) -> dict:
        """A streamed /generate: server-sent events `data: {...}` then `data: [DONE]`. SGLang sends
        each event's output_ids and log-prob rows either from the start of the output (its default)
        or as the new ones only (`--incremental-streaming-output`); both are read (`completion_tokens`
        counts the whole output) and only the new tokens go to `turn`."""
        url = address + "/generate"
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=self.connect_timeout_s)
        attempt, seen, last, texts = 0, 0, None, []
        while True:
            try:
                async with self._http().post(url, json=body, timeout=timeout) as response:
                    if response.status >= 400:
                        message = f"HTTP {response.status}: {_error_message(await response.text())}"
                        raise InferenceServerError(f"POST {url} was refused with {message}", address=address,
                                                   status=response.status if response.status < 500 else None)
                    buffer, done = b"", False
                    async for data in response.content.iter_any():
                        buffer += data
                        while not done and b"\n\n" in buffer:
                            event, buffer = buffer.split(b"\n\n", 1)
                            answer = _sse_data(event, url, address)
                            done = answer is _DONE
                            if answer is None or done:
                                continue
                            seen, last = _take_streamed(answer, seen, texts, turn, version, address)
                            if turn.cut is not None:  # a stop string: the rest of the stream is not the turn
                                response.close()
                                return {**last, "text": ""}
                        if done:
                            break
                    if last is None or last["finish_reason"] is None:
                        raise InferenceServerError(f"the stream of POST {url} ended before the generation finished "
                                                   f"({seen} tokens)", address=address)
                    return {**last, "text": last["text"] if last["cumulative"] else "".join(texts)}
            except aiohttp.ClientConnectorError as e:  # nothing reached the server: safe to send again
                if attempt >= self.max_retries:
                    raise InferenceServerError(f"POST {url} failed after {attempt + 1} attempt(s): cannot connect "
                                               f"({e})", address=address) from None
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                raise InferenceServerError(f"the stream of POST {url} failed after {seen} tokens: "
                                           f"{type(e).__name__}: {e}", address=address) from None
            await asyncio.sleep(self.retry_backoff_s * 2 ** attempt)
            attempt += 1

    def _abort_in_background(self, address: str, rid: str):
        """Ask the server to abort request `rid` without waiting for its answer (the caller may be
        cancelled already); a failure is only logged by its absence: the server's own timeout and
        its check for a client that left remain."""
        task = asyncio.get_running_loop().create_task(
            self._request("POST", address, "/abort_request", {"rid": rid, "abort_all": False}, retry=False,
                          expect_json=False))
        self._aborts.add(task)
        task.add_done_callback(lambda t: (self._aborts.discard(t), t.cancelled() or t.exception()))

    def end_trajectory(self, trajectory_id):
        """Forget the route of a finished trajectory (it no longer counts towards its server's load)."""
        address = self._routes.pop(trajectory_id, None)
        if address is not None:
            self._live_trajectories[address] -= 1

    def _route(self, trajectory_id) -> str:
        if trajectory_id is not None and trajectory_id in self._routes:
            return self._routes[trajectory_id]
        index = min(range(len(self.addresses)),
                    key=lambda i: (self._live_trajectories[self.addresses[i]], self._in_flight[self.addresses[i]], i))
        address = self.addresses[index]
        if trajectory_id is not None:
            self._routes[trajectory_id] = address
            self._live_trajectories[address] += 1
        return address

    async def _acquire_send_slot(self):
        # Requests wait here, not at the server, while paused: a request the server held through a
        # weight update would be generated by the new weights but tagged with the old version.
        while True:
            await self._resumed.wait()
            await self._semaphore.acquire()
            if not self._paused:
                return
            self._semaphore.release()

    # --- control calls, sent to every server ---
    async def pause_generation(self, mode: str = "abort") -> list[dict]:
        """Stop generation on every server. mode "abort" answers in-flight requests, which
        `generate` re-sends after `continue_generation`; "in_place" and "retract" hold them on the
        server (then a weight update must pass flush_cache=False). docs/client.md has the trade-offs."""
        self._bind_loop()
        self._paused = True
        self._pause_count += 1
        self._resumed.clear()
        return await self._fan_out("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self, version: int | None = None) -> list[dict]:
        """Resume every server, then release waiting and paused requests; with `version`, set it
        first so that the re-sent pieces are tagged with the new policy version."""
        self._bind_loop()
        try:
            return await self._fan_out("POST", "/continue_generation", {})
        finally:
            if version is not None:
                self.set_version(version)
            self._paused = False
            self._resumed.set()

    async def flush_cache(self) -> list[str]:
        """Drop every server's prefix cache. SGLang refuses (400) while requests run or wait."""
        return await self._fan_out("POST", "/flush_cache", None, expect_json=False)

    async def abort_request(self, rid: str | None = None, abort_all: bool = True) -> None:
        """Abort request `rid` (an SGLang rid prefix) or, with no rid, every request on every server.
        Aborted `generate` calls raise `GenerationAborted` (they are not re-sent unless paused)."""
        await self._fan_out("POST", "/abort_request", {"rid": rid or "", "abort_all": rid is None and abort_all})

    async def get_server_info(self) -> list[dict]:
        return await self._fan_out("GET", "/server_info", None)

    async def get_model_info(self) -> list[dict]:
        return await self._fan_out("GET", "/model_info", None)

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None, *,
                                      flush_cache: bool = True, abort_all_requests: bool = False) -> list[dict]:
        """Every server loads the HF checkpoint at `model_path` (on a failed load SGLang keeps the old weights).

        Not blindly retried (a load must not run twice by accident), but safe against a dropped
        connection: with `weight_version` given, a call whose answer was lost asks the server which
        version it holds (`/model_info`) and sends the update again only if it was not applied."""
        body = {"model_path": model_path, "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._fan_out("POST", "/update_weights_from_disk", body, send=self._update_checked)

    async def _update_checked(self, method: str, address: str, path: str, body: dict):
        try:
            return await self._request(method, address, path, body, retry=False)
        except InferenceServerError as e:
            if e.status is not None or body.get("weight_version") is None:
                raise  # refused (4xx), or no version to tell whether it was applied
            lost = e
        # The answer was lost (dropped connection, timeout, 5xx): the update may or may not have run.
        info = await self._request("GET", address, "/model_info", None)
        if str(info.get("weight_version")) == body["weight_version"]:
            return {"success": True, "message": f"applied; its answer was lost ({lost})", "num_paused_requests": 0}
        return await self._request(method, address, path, body, retry=False)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offsets: list[int] | int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> list[dict]:
        """Every server joins the trainer's process group (trainer = rank 0, server i's TP ranks start at
        rank_offsets[i]). Blocks until all ranks have joined: the trainer must join concurrently."""
        if isinstance(rank_offsets, int):
            if len(self.addresses) > 1:
                raise ValueError(f"rank_offsets must be a list with one offset per server ({len(self.addresses)} "
                                 f"servers), e.g. [1, 1 + tp_size, ...]")
            rank_offsets = [rank_offsets]
        if len(rank_offsets) != len(self.addresses):
            raise ValueError(f"rank_offsets has {len(rank_offsets)} entries for {len(self.addresses)} servers")
        bodies = [{"master_address": master_address, "master_port": int(master_port), "rank_offset": int(offset),
                   "world_size": int(world_size), "group_name": group_name, "backend": backend}
                  for offset in rank_offsets]
        return await self._fan_out("POST", "/init_weights_update_group", bodies, retry=False)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list,
                                              group_name: str = "weight_update_group", flush_cache: bool = True,
                                              weight_version: str | None = None, load_format: str | None = None,
                                              abort_all_requests: bool = False) -> list[dict]:
        """Every server receives one broadcast(src=0) per name, in this order, with these dtypes
        ("bfloat16" or torch.bfloat16) and full shapes; the trainer broadcasts concurrently."""
        body = {"names": list(names), "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
                "shapes": [[int(x) for x in s] for s in shapes], "group_name": group_name,
                "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if load_format is not None:
            body["load_format"] = load_format
        return await self._fan_out("POST", "/update_weights_from_distributed", body, retry=False)

    async def update_weights_from_tensor(self, serialized_named_tensors: str, tp_size: int = 1,
                                         weight_version: str | None = None, flush_cache: bool = True,
                                         abort_all_requests: bool = False) -> list[dict]:
        """Every server on this machine loads the trainer's tensors through their handles
        (`lib.tensor_ipc.serialize_named_tensors`; CUDA IPC, no copy to disk). One payload entry
        per TP rank, each the whole set (a rank takes its own shard). Not retried: the tensors must
        stay alive until this returns."""
        body = {"serialized_named_tensors": [serialized_named_tensors] * tp_size, "flush_cache": flush_cache,
                "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._fan_out("POST", "/update_weights_from_tensor", body, retry=False)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> list[dict]:
        """Every server loads the PEFT adapter directory `lora_path` as `lora_name` (SGLang needs
        `--enable-lora`); a name already loaded is refused. Not retried: a load must not run twice."""
        return await self._fan_out("POST", "/load_lora_adapter",
                                   {"lora_name": lora_name, "lora_path": lora_path, "pinned": pinned}, retry=False)

    async def unload_lora_adapter(self, lora_name: str) -> list[dict]:
        """Every server drops adapter `lora_name`; requests naming it from now on are refused."""
        return await self._fan_out("POST", "/unload_lora_adapter", {"lora_name": lora_name}, retry=False)

    async def prompt_logprobs(self, input_ids: list[int], lora_path: str | None = None) -> list[list[float]]:
        """Each server's log-probs [T - 1] of tokens 1.. of `input_ids` (its untempered prompt log-probs),
        under adapter `lora_path` (None: the base weights): a probe of what the servers serve."""
        body = {"input_ids": [int(t) for t in input_ids], "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        if lora_path is not None:
            body["lora_path"] = lora_path
        answers = await self._fan_out("POST", "/generate", body)
        return [[float(row[0]) for row in answer["meta_info"]["input_token_logprobs"][1:]] for answer in answers]

    async def release_memory_occupation(self, tags: list[str] | None = None) -> list[dict]:
        """Every server frees its GPU memory (`tags`: "weights", "kv_cache"; None = all) so that a
        trainer on the same GPU can use it. SGLang needs `--enable-memory-saver`; no request may
        run meanwhile (pause generation first)."""
        return await self._fan_out("POST", "/release_memory_occupation", {"tags": tags}, expect_json=False)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> list[dict]:
        """Every server takes back what `release_memory_occupation(tags)` freed. Released weights
        come back with undefined values: sync the weights before generating again."""
        return await self._fan_out("POST", "/resume_memory_occupation", {"tags": tags}, expect_json=False)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> list[dict]:
        return await self._fan_out("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def close(self):
        if self._aborts:  # let the aborts of requests given up reach their servers
            await asyncio.wait(list(self._aborts), timeout=5.0)
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    # --- HTTP ---
    def _bind_loop(self):
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        if self._loop is not None and not self._loop.is_closed() and self._loop.is_running():
            raise RuntimeError("this InferenceClient is already in use on another running event loop; call it from "
                               "one loop only (e.g. through lib.async_rollout.BackgroundLoop.run) or make one "
                               "client per loop")
        self._loop = loop
        self._session = None
        self._semaphore = asyncio.Semaphore(self.max_concurrent_requests)
        self._resumed = asyncio.Event()
        if not self._paused:
            self._resumed.set()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # limit=0: the semaphore bounds generation; control calls (pause!) must never queue
            # behind generation requests for a pooled connection. keepalive_timeout under the
            # servers' own (uvicorn, which serves SGLang, closes idle connections after 5 s): a
            # request sent on a connection the server is closing fails with ServerDisconnectedError.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0))
        return self._session

    async def _fan_out(self, method: str, path: str, body, *, retry: bool = True, expect_json: bool = True,
                       send=None) -> list:
        """The call on every server; `send(method, address, path, body)` replaces a plain `_request`."""
        self._bind_loop()
        bodies = body if isinstance(body, list) else [body] * len(self.addresses)
        if send is None:
            send = functools.partial(self._request, retry=retry, expect_json=expect_json)

        async def tracked(address, body):
            call = f"{method} {address}{path}"
            self.calls_in_flight[call] += 1
            try:
                return await send(method, address, path, body)
            finally:
                self.calls_in_flight[call] -= 1
                self.calls_in_flight += collections.Counter()  # drops the calls answered
        # Every server gets the call even if one fails, so none is left e.g. paused alone.
        results = await asyncio.gather(*(tracked(a, b) for a, b in zip(self.addresses, bodies)),
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        for address, result in zip(self.addresses, results):
            if isinstance(result, dict) and result.get("success") is False:
                message = result.get("message") or result.get("error_message")  # LoRA calls: error_message
                raise InferenceServerError(f"{method} {address}{path} failed: {message}", address=address)
        return results

    async def _request(self, method: str, address: str, path: str, body=None, *, retry: bool = True,
                       expect_json: bool = True):
        """One HTTP call with retries: connection failures always retry (nothing reached the server),
        timeouts, dropped connections and 5xx only when `retry` (the call is safe to repeat), 4xx never."""
        url = address + path
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=self.connect_timeout_s)
        attempt = 0
        while True:
            try:
                async with self._http().request(method, url, json=body, timeout=timeout) as response:
                    text = await response.text()
                    if response.status < 400:
                        if not expect_json:
                            return text
                        return json.loads(text) if text.strip() else {}
                    message = f"HTTP {response.status}: {_error_message(text)}"
                    if response.status < 500:
                        raise InferenceServerError(f"{method} {url} was refused with {message}", address=address,
                                                   status=response.status)
                    error, may_retry = message, retry
            except aiohttp.ClientConnectorError as e:
                error, may_retry = f"cannot connect ({e})", True
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                error, may_retry = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__, retry
            if not may_retry or attempt >= self.max_retries:
                raise InferenceServerError(
                    f"{method} {url} failed after {attempt + 1} attempt(s): {error}. Check that the inference "
                    f"server is running and reachable (its log says why it stopped), or raise max_retries / "
                    f"request_timeout_s ({self.request_timeout_s} s)", address=address)
            await asyncio.sleep(self.retry_backoff_s * 2 ** attempt)
            attempt += 1


def model_eos_ids(model_path: str, tokenizer) -> list[int]:
    """Every id that ends a model turn: the tokenizer's EOS and generation_config.json's
    `eos_token_id` (an int or a list; Qwen2.5-Instruct lists <|im_end|> and <|endoftext|>). Pass
    them as `stop_token_ids` so the client ends a turn on any of them."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    try:
        from transformers import GenerationConfig

        extra = GenerationConfig.from_pretrained(model_path).eos_token_id
    except (OSError, ValueError):  # no generation_config.json: the tokenizer's EOS is all there is
        extra = None
    for token in [extra] if isinstance(extra, int) else (extra or []):
        if int(token) not in ids:
            ids.append(int(token))
    return ids


def _parse_generation(answer: dict, address: str, final: bool = True) -> dict:
    """The fields of one /generate answer (or, `final=False`, of a streamed event before the last)
    that a Generation is built from (see docs/client.md)."""
    try:
        meta = answer["meta_info"]
        output_ids = [int(t) for t in answer["output_ids"]]
        rows = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs")
        reason = (meta["finish_reason"] or {}) if final else None
        finish_reason = reason["type"] if final else None
    except (KeyError, TypeError, ValueError) as e:
        raise InferenceServerError(f"/generate at {address} answered without {e}; expected SGLang's shape "
                                   f"(output_ids, meta_info.finish_reason, meta_info.output_token_logprobs): "
                                   f"{str(answer)[:500]}", address=address) from None
    agree = len(rows) == len(output_ids) and all(isinstance(row, (list, tuple)) and len(row) >= 2 and row[1] == t
                                                 for row, t in zip(rows, output_ids))
    if not agree:
        if finish_reason != "abort":
            raise InferenceServerError(
                f"/generate at {address} returned {len(output_ids)} output_ids but {len(rows)} log-prob rows whose "
                f"token ids {'differ' if len(rows) == len(output_ids) else 'do not line up'}; every sampled token "
                f"needs its log-prob", address=address)
        # An aborted piece is re-sent from what it kept: keep only the tokens that have their log-prob.
        keep = 0
        while (keep < min(len(rows), len(output_ids)) and isinstance(rows[keep], (list, tuple))
               and len(rows[keep]) >= 2 and rows[keep][1] == output_ids[keep]):
            keep += 1
        output_ids, rows = output_ids[:keep], rows[:keep]
    try:
        logprobs = [float(row[0]) for row in rows]
    except (TypeError, ValueError):
        logprobs = [math.nan]
    if not all(math.isfinite(lp) for lp in logprobs):
        raise InferenceServerError(f"/generate at {address} returned a log-prob that is not a finite number "
                                   f"({str(rows)[:300]}); every sampled token needs its log-prob", address=address)
    top = None
    if tops is not None:
        try:  # SGLang's rows [logprob, token id, text | None] of each position's most likely tokens
            top = [[(float(row[0]), int(row[1])) for row in position] for position in tops[:len(output_ids)]]
        except (TypeError, ValueError, IndexError):
            top = []
        if len(top) != len(output_ids):
            raise InferenceServerError(f"/generate at {address} returned top log-probs for {len(tops)} of "
                                       f"{len(output_ids)} tokens: {str(tops)[:300]}", address=address)
    token_texts = [str(row[2]) if len(row) > 2 and row[2] is not None else "" for row in rows]
    if final and token_texts and not any(token_texts):
        # A server that ignores return_text_in_logprobs: its text, on the piece's last token, still
        # shows a stop string that the piece's last token completed (a pause or length cut landed).
        token_texts[-1] = answer.get("text") or ""
    reason = reason or {}
    return {"output_ids": output_ids, "logprobs": logprobs, "top": top, "token_texts": token_texts,
            "finish_reason": finish_reason, "matched": reason.get("matched"), "text": answer.get("text") or "",
            "abort_message": reason.get("message"),
            "cached_tokens": int(meta.get("cached_tokens") or 0),
            "weight_version": str(meta.get("weight_version", ""))}


_DONE = object()  # a stream's `data: [DONE]`


def _sse_data(event: bytes, url: str, address: str):
    """The JSON object of one server-sent event, _DONE for `data: [DONE]`, None for one without data.
    SGLang reports a request it refuses after the stream began as `data: {"error": {...}}`."""
    data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
    if not data:
        return None
    if data == b"[DONE]":
        return _DONE
    try:
        answer = json.loads(data)
    except ValueError:
        raise InferenceServerError(f"the stream of POST {url} sent an event that is not JSON: {data[:300]!r}",
                                   address=address) from None
    if not isinstance(answer, dict):
        raise InferenceServerError(f"the stream of POST {url} sent {data[:300]!r}, not an object", address=address)
    if "error" in answer and "output_ids" not in answer:
        raise InferenceServerError(f"POST {url} was refused: {_error_message(data.decode(errors='replace'))}",
                                   address=address, status=400)
    return answer


def _take_streamed(answer: dict, seen: int, texts: list, turn: "_Turn", version: int, address: str):
    """One streamed event of a piece whose first `seen` tokens were taken: its new tokens go to
    `turn`. Returns (tokens taken from this piece, the piece's finish fields so far)."""
    meta = answer.get("meta_info") if isinstance(answer.get("meta_info"), dict) else {}
    ids, total = answer.get("output_ids"), meta.get("completion_tokens")
    if not isinstance(ids, list):
        raise InferenceServerError(f"/generate at {address} streamed an event without output_ids: {str(answer)[:300]}",
                                   address=address)
    if seen and isinstance(total, int):
        cumulative = len(ids) == total
    else:  # the first event, or no count: from the start if it begins with what was taken
        cumulative = seen > 0 and ids[:seen] == turn.output_ids[len(turn.output_ids) - seen:]
    if cumulative:
        meta = {**meta, "output_token_logprobs": (meta.get("output_token_logprobs") or [])[seen:]}
        if meta.get("output_top_logprobs") is not None:
            meta["output_top_logprobs"] = meta["output_top_logprobs"][seen:]
        ids = ids[seen:]
    final = meta.get("finish_reason") is not None
    piece = _parse_generation({"output_ids": ids, "meta_info": meta, "text": answer.get("text")}, address, final=final)
    if not cumulative and answer.get("text"):
        texts.append(answer["text"])
    turn.add(piece, version)
    return seen + len(piece["output_ids"]), {**piece, "cumulative": cumulative}


class _Turn:
    """The tokens of one generate() call as they arrive, piece after piece (and event after event
    when streamed). Each token's text is checked for a stop string as it comes, and the turn is cut
    at the token that completes one (`cut`); `on_tokens` gets exactly the tokens kept."""

    def __init__(self, stop: list[str], on_tokens):
        self.stop, self.on_tokens = stop, on_tokens
        self.longest_stop = max(map(len, stop), default=0)
        self.output_ids, self.logprobs, self.versions, self.top = [], [], [], []
        self.token_texts, self.texts = [], []
        self.stop_tail = ""  # the last characters of the output, as many as the longest stop string
        self.cut = None  # the stop string that ended the turn

    def add(self, piece: dict, version: int):
        ids, keep = piece["output_ids"], len(piece["output_ids"])
        if self.stop:
            for i, token_text in enumerate(piece["token_texts"]):
                tail = self.stop_tail + token_text
                hit = next((s for s in self.stop if s in tail), None)
                self.stop_tail = tail[-self.longest_stop:]
                if hit is not None:
                    self.cut, keep = hit, i + 1
                    break
            self.token_texts += piece["token_texts"][:keep]
        self.output_ids += ids[:keep]
        self.logprobs += piece["logprobs"][:keep]
        self.versions += [version] * keep
        if piece["top"] is not None:
            self.top += piece["top"][:keep]
        if self.on_tokens is not None and keep:
            self.on_tokens(ids[:keep], piece["logprobs"][:keep], piece["top"][:keep] if piece["top"] is not None else None)


def _error_message(text: str) -> str:
    """The message in SGLang's error bodies ({"error": {"message"}}, {"message"}, or plain text)."""
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()[:2000]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if body.get("message"):
            return str(body["message"])
        if body.get("error_message"):  # SGLang's LoRAUpdateOutput
            return str(body["error_message"])
    return text.strip()[:2000]
