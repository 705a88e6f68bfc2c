"""An inference server on transformers + aiohttp that speaks SGLang 0.5.15's HTTP subset.

For machines where SGLang cannot run (CPU machines, CI, laptops): the launcher and client in lib
talk to it exactly as they talk to `python -m sglang.launch_server`, and its command-line flags are
SGLang's where SGLang has them:

    python -m lib.cpu_server --model-path PATH [--port 30000] [--device cpu|cuda] [--dtype auto]

Endpoints: /generate, /health, /health_generate, /get_model_info, /get_server_info, /flush_cache,
/pause_generation, /continue_generation, /abort_request, /update_weights_from_disk,
/init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group,
/update_weights_from_tensor, /release_memory_occupation, /resume_memory_occupation, /load_lora_adapter,
/unload_lora_adapter (and `lora_path` in /generate: lib/lora_serving.py).
The field names and response shapes follow docs/sglang_contract.md. This module is the HTTP side
(the aiohttp app, its handlers by route family); the model, batching, sampling and weights are
lib/cpu_engine.py's.

Where it differs from SGLang (docs/sglang_contract.md has SGLang's side):
- `/health` answers 200 without generating (SGLang's runs a 1-token generation and so gives 503
  while paused); `/health_generate` does generate.
- No prefix cache: `cached_tokens` is always 0 and `/flush_cache` has nothing to flush.
- `retract` pauses like `in_place` (nothing to free); an aborted running request ends without the
  one extra decode step SGLang runs; `num_retractions` and `reasoning_tokens` are always 0.
- Not supported, refused with a 400 rather than ignored: penalties, grammars, `logit_bias`;
  `stream` with a batch or n > 1. A streamed request's events carry the output so far (SGLang's
  default) or only what is new (`--incremental-streaming-output`), text included.
- `top_logprobs_num` gives `output_top_logprobs` (from the same log-probs as the sampled token's)
  and, with `logprob_start_len >= 0`, `input_top_logprobs` (the untempered prompt log-probs; None at
  the first prompt token, which has none).
- `--random-seed` defaults to 0 (SGLang: random); `--dtype auto` is float32 on CPU.
- `/update_weights_from_tensor` takes only lib.tensor_ipc's payload (handles of shared tensors;
  any other pickle content is a 400) and no `load_format`.
- `/release_memory_occupation` frees nothing (there is no KV pool to free, and the weights stay
  where they are); it marks the server released, so that /generate is refused (400) until
  `/resume_memory_occupation`, and it is itself refused while requests run or wait.
- LoRA: adapters load without `--enable-lora` (and with no `--max-lora-rank`, `--max-loras-per-batch`
  or `--max-loaded-loras` bound); `pinned` is accepted and has no effect (nothing is evicted);
  unloading does not wait for the requests that use the adapter: they finish with it, new ones
  naming it get the 400 an unknown adapter gets. PEFT directories of plain LoRA on linear modules
  only (no DoRA, biases, modules_to_save, rank patterns), refused with a 400 otherwise.
- Weight updates copy tensors by their Hugging Face state-dict names (SGLang's `load_weights`
  also accepts those names).
- Stricter than SGLang on hostile input, all refused with a 400 before anything runs:
  sampling numbers out of range (`top_k` beyond the vocabulary, `temperature` above
  MAX_TEMPERATURE, seeds outside int64, ...), more than MAX_STOP_STRINGS stop strings or
  MAX_STOP_CHARS characters of them, strings holding a lone surrogate (`"\ud800"`), NaN/Infinity
  literals, `rank_offset` 0 (the server would become the broadcast source), non-float dtypes, and
  names or shapes the model lacks. One group join or distributed receive at a time: another one
  meanwhile is a 409.
- `sampling_seed` is hashed (all 64 bits) into the request's generator seed, so a seed gives other
  samples than SGLang's for the same seed (as every sample here does).

Hostile input (limits are the constants below and the flags): a request body must arrive within
--body-timeout-s (else 408) and fit --max-body-mb (else 413); a `text` longer than the context could
hold is refused before it is tokenized, and tokenizing and checkpoint reads run off the event loop,
so /health keeps answering; a client that disconnects cancels its handler and frees its rows at the
next step (pauses, weight updates and group joins run to the end regardless). A request that breaks
a step fails alone where it can be told apart: a row with no token left to sample ends with an
abort, and a failed prefill is retried one newcomer at a time (lib/cpu_engine.py, Runner.step).
"""
import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import re
import threading
import time

import torch
from aiohttp import web

from lib.cpu_engine import Server, checked_number, short_repr
from lib.http_body import BadRequest, errors_as_json, lone_surrogate, parse_json_body, read_body

logger = logging.getLogger("cpu_server")

MAX_BODY_BYTES = web.AppKey("max_body_bytes", int)
BODY_TIMEOUT_S = web.AppKey("body_timeout_s", float)
SCHEDULER_TASK = web.AppKey("scheduler", asyncio.Task)
MAX_WORLD_SIZE = 2**16
WEIGHT_DTYPES = ("float32", "bfloat16", "float16", "float64")  # what a weight update may send
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's /release_memory_occupation tags


def _field(body: dict, name: str, kind: type, default=None, required: bool = False):
    """body[name] if it is a `kind` (a bool is not an int), the default when absent or null."""
    value = body.get(name)
    if value is None:
        if required:
            raise BadRequest(f"missing field {name!r}")
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise BadRequest(f"{name} must be {kind.__name__}, got {short_repr(value)}")
    return value


def _on_daemon_thread(fn) -> asyncio.Future:
    """fn() on a new daemon thread, as a future of the running loop. For a call that may never
    return: torch's TCPStore client waits for the store's first reply with no timeout (torch 2.13),
    so a join to a listener that never answers would hold an executor's thread, and the process's
    exit, for good. Such a thread is left behind instead (one per --weight-sync-timeout-s at most,
    since joins go one at a time) until the listener closes its connection."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error):
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def run():
        try:
            result, error = fn(), None
        except Exception as e:
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop has closed meanwhile
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="weight-group-join", daemon=True).start()
    return future


def _parse_dtype(name) -> torch.dtype:
    name = name.removeprefix("torch.") if isinstance(name, str) else name
    if name not in WEIGHT_DTYPES:
        raise BadRequest(f"dtype {short_repr(name)} is not a weight dtype; use one of {list(WEIGHT_DTYPES)}")
    return getattr(torch, name)


# --- HTTP handlers ---

def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def _refuse_constant(name: str):
    raise BadRequest(f"{name} is not a JSON number; send finite numbers")


# UTF-8 cannot carry a surrogate, so only a JSON escape (\ud800) can put one into a string.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _check_unicode(body: dict):
    """A 400 naming the field of the first string that holds a lone surrogate (an escape not part of
    a pair): not text, it cannot be encoded to UTF-8, and the tokenizer raised on it (a 500)."""
    if found := lone_surrogate(body):
        field, text, at = found
        raise BadRequest(f"{field} holds a lone UTF-16 surrogate ({text[at]!r} at character {at}); send valid "
                         "Unicode text")


async def _json_body(request: web.Request, allow_empty: bool = True):
    raw = await read_body(request, max_body_bytes=request.app[MAX_BODY_BYTES], timeout_s=request.app[BODY_TIMEOUT_S],
                          too_large_hint="raise the server's --max-body-mb")
    body = parse_json_body(raw, allow_empty=allow_empty, parse_constant=_refuse_constant)
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):  # walked only then: a body of millions of token ids costs nothing extra
        _check_unicode(body)
    return body


async def _stream_events(request, events) -> web.StreamResponse:
    """Server-sent events, `data: {...}` each, then `data: [DONE]`, as SGLang streams /generate."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        async for event in events:
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:  # the client left: `events` was closed, which aborted its request
        pass
    finally:
        await events.aclose()
    return response


def _finish_even_if_client_leaves(handler):
    """A client that disconnects cancels its handler (handler_cancellation), which frees the rows
    of a /generate; a pause, weight update or group join must instead finish, or fail, as a whole
    (a cancelled pause would also cancel the other clients' futures it waits on)."""
    async def shielded(request):
        return await asyncio.shield(handler(request))
    return shielded


def _generation_routes(server: Server) -> list:
    """/generate (plain or streamed) and the health checks."""
    runner = server.runner

    async def generate(request):
        body = await _json_body(request, allow_empty=False)
        if server.released:
            raise BadRequest(f"the server's memory is released ({sorted(server.released)}); "
                             f"call /resume_memory_occupation first")
        requests, is_batch = await server.build_requests(body)
        if requests[0].progress is not None:
            return await _stream_events(request, server.stream(requests[0]))
        done = await server.submit(requests)
        out = [server.response(r) for r in done]
        return web.json_response(out if is_batch else out[0])

    async def health(request):
        return web.Response(status=200)

    async def health_generate(request):
        req, _ = await server.build_requests({"input_ids": [runner.pad_token_id],
                                              "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        try:
            await asyncio.wait_for(asyncio.shield(server.submit(req)), timeout=server.args.health_timeout_s)
        except asyncio.TimeoutError:
            req[0].abort_message = "health check timed out"
            server.wakeup.set()
            return _error(503, f"a 1-token generation did not finish within {server.args.health_timeout_s} s"
                               + (" (generation is paused)" if server.paused else ""))
        return web.Response(status=200)

    return [web.post("/generate", generate),
            web.put("/generate", generate),
            web.get("/health", health),
            web.get("/health_generate", health_generate)]


def _info_routes(server: Server) -> list:
    """What the server runs: model and server info (under both of SGLang's names)."""
    runner = server.runner

    async def get_model_info(request):
        return web.json_response({"model_path": server.model_path,
                                  "tokenizer_path": server.args.tokenizer_path or server.args.model_path,
                                  "is_generation": True, "preferred_sampling_params": None,
                                  "weight_version": server.weight_version, "has_image_understanding": False,
                                  "has_audio_understanding": False, "model_type": runner.model.config.model_type,
                                  "architectures": getattr(runner.model.config, "architectures", None)})

    async def get_server_info(request):
        info = {k: v for k, v in vars(server.args).items()}
        info.update(runner.stats)
        info.update({"model_path": server.model_path, "weight_version": server.weight_version,
                     "context_length": runner.context_length, "version": "lib.cpu_server",
                     "num_running_requests": len(runner.rows), "num_waiting_requests": len(server.waiting),
                     "paused": server.paused, "internal_states": [dict(runner.stats)],
                     "loaded_lora_adapters": runner.adapters.paths()})
        return web.json_response(info)

    return ([web.get(path, get_model_info) for path in ("/get_model_info", "/model_info")]
            + [web.get(path, get_server_info) for path in ("/get_server_info", "/server_info")])


def _control_routes(server: Server) -> list:
    """Generation control: pause, continue, abort, the prefix cache."""
    runner = server.runner

    async def flush_cache(request):
        # No prefix cache here, so there is nothing to flush; answered as SGLang answers (plain
        # text; refused while requests are running or waiting, as SGLang's scheduler does).
        if runner.rows or server.waiting:
            return web.Response(status=400, text="Cache not flushed because there are pending requests. "
                                                 f"#queue-req: {len(server.waiting)}, #running-req: {len(runner.rows)}\n")
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                                 "(When there are running or waiting requests, the operation will not be performed.)\n")

    async def pause_generation(request):
        body = await _json_body(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise BadRequest(f"mode must be 'abort', 'in_place' or 'retract', got {mode!r}")
        server.paused = True
        if mode == "abort":
            # Requests sent from now on wait for /continue_generation; only these are aborted.
            in_flight = server.waiting + server.runner.rows
            server.abort()
            await asyncio.gather(*(r.future for r in in_flight))
        # Return only once no forward is in flight, so a weight update that follows never
        # overlaps a step.
        while not server.idle.is_set():
            await asyncio.sleep(0.005)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(request):
        await _json_body(request)
        server.paused = False
        server.wakeup.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(request):
        body = await _json_body(request)
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(abort_all, bool) or not isinstance(rid, (str, type(None))):
            raise BadRequest("abort_request takes {'rid': str, 'abort_all': bool}")
        if abort_all:
            server.abort()
        elif rid:
            server.abort(rid)
        return web.Response(status=200)

    return [web.route("*", "/flush_cache", flush_cache),
            web.post("/pause_generation", _finish_even_if_client_leaves(pause_generation)),
            web.post("/continue_generation", continue_generation),
            web.post("/abort_request", abort_request)]


def _weight_routes(server: Server) -> list:
    """Weight updates from disk and from tensor handles, the weight version, memory release."""
    runner = server.runner

    async def update_weights_from_disk(request):
        body = await _json_body(request, allow_empty=False)
        path = _field(body, "model_path", str, required=True)
        version = _field(body, "weight_version", str)
        abort_all = _field(body, "abort_all_requests", bool, False)
        t0 = time.monotonic()
        try:
            # Read and checked on an executor thread while requests carry on; only the copy waits
            # for in-flight requests, and it starts once the whole checkpoint has passed the checks.
            named = await asyncio.get_running_loop().run_in_executor(None, runner.read_checkpoint, path)
            async with server.exclusive_update(abort_all):
                await server.run_on_worker(runner.copy_named_tensors, named)
        except Exception as e:  # as SGLang: any failed load is a 400 with success false, old weights kept
            logger.warning("update_weights_from_disk(%r) failed: %r", path, e)
            return web.json_response({"success": False, "message": f"Failed to update weights: {e}",
                                      "num_paused_requests": 0}, status=400)
        server.model_path = path
        if version is not None:
            server.weight_version = version
        return web.json_response({"success": True, "num_paused_requests": 0,
                                  "message": f"Succeeded to update model weights in {time.monotonic() - t0:.2f} s."})

    async def update_weights_from_tensor(request):
        from lib.tensor_ipc import PayloadError, load_named_tensors

        body = await _json_body(request, allow_empty=False)
        entries = body.get("serialized_named_tensors")
        version = _field(body, "weight_version", str)
        abort_all = _field(body, "abort_all_requests", bool, False)
        _field(body, "flush_cache", bool, True)  # no prefix cache: checked, nothing to flush
        if _field(body, "load_format", str) is not None:
            raise BadRequest("load_format is not supported here; send null (lib.tensor_ipc's payload)")
        if not (isinstance(entries, list) and entries and all(isinstance(e, str) for e in entries)):
            raise BadRequest("serialized_named_tensors must be a non-empty list of base64 strings, one per TP rank")

        def load():  # opening shared memory / IPC handles: off the event loop
            named = load_named_tensors(entries[0], int(server.args.max_body_mb * 2**20))
            runner.check_named_shapes([n for n, _ in named], [list(t.shape) for _, t in named])
            for name, tensor in named:
                if not tensor.is_floating_point():
                    raise BadRequest(f"{name!r} was sent as {tensor.dtype}; weights are floating point")
            return named
        try:
            named = await asyncio.get_running_loop().run_in_executor(None, load)
            async with server.exclusive_update(abort_all):
                await server.run_on_worker(runner.copy_named_tensors, named)
        except (BadRequest, PayloadError) as e:  # checked before any weight changed
            return web.json_response({"success": False, "message": f"Failed to update weights: {e}"}, status=400)
        del named  # the trainer's memory is only borrowed until we answer
        if version is not None:
            server.weight_version = version
        return web.json_response({"success": True, "message": "Success"})

    def _memory_tags(body) -> set:
        tags = body.get("tags") if isinstance(body, dict) else None
        if tags is None:
            return set(MEMORY_TAGS)
        if not (isinstance(tags, list) and all(t in MEMORY_TAGS for t in tags)):
            raise BadRequest(f"tags must be null or a list of {list(MEMORY_TAGS)}, got {short_repr(tags)}")
        return set(tags)

    async def release_memory_occupation(request):
        tags = _memory_tags(await _json_body(request))
        if runner.rows or server.waiting:
            raise BadRequest(f"requests are running ({len(runner.rows)}) or waiting ({len(server.waiting)}); "
                             f"pause generation (mode abort) before releasing memory")
        server.released |= tags
        return web.json_response(None)

    async def resume_memory_occupation(request):
        server.released -= _memory_tags(await _json_body(request))
        return web.json_response(None)

    async def update_weight_version(request):
        body = await _json_body(request, allow_empty=False)
        version = _field(body, "new_version", str)
        if not version:
            raise BadRequest("new_version (a non-empty string) is required")
        if _field(body, "abort_all_requests", bool, True):
            server.abort()
        server.weight_version = version
        return web.json_response({"success": True, "message": f"Weight version updated to {version}",
                                  "new_version": version})

    return [web.post("/update_weights_from_disk", _finish_even_if_client_leaves(update_weights_from_disk)),
            web.post("/update_weights_from_tensor", _finish_even_if_client_leaves(update_weights_from_tensor)),
            web.post("/update_weight_version", update_weight_version),
            web.route("*", "/release_memory_occupation", release_memory_occupation),
            web.route("*", "/resume_memory_occupation", resume_memory_occupation)]


def _weight_group_routes(server: Server) -> list:
    """Weight updates through the trainer's process group: join, receive a broadcast, leave."""
    runner = server.runner

    async def init_weights_update_group(request):
        body = await _json_body(request, allow_empty=False)
        try:
            addr, port = body["master_address"], body["master_port"]
            rank_offset, world_size = body["rank_offset"], body["world_size"]
        except KeyError as e:
            raise BadRequest(f"missing field {e.args[0]!r}; need master_address, master_port, rank_offset, "
                             f"world_size (and optionally group_name, backend)")
        if not isinstance(addr, str) or not addr:
            raise BadRequest(f"master_address must be a non-empty string, got {short_repr(addr)}")
        port = checked_number("master_port", port, int, 1, 65535)
        world_size = checked_number("world_size", world_size, int, 2, MAX_WORLD_SIZE)
        # Rank 0 is the trainer, the source of every broadcast: a server there would "receive" its
        # own uninitialised buffers. This server is one rank, so it must also be below world_size.
        rank_offset = checked_number("rank_offset (rank 0 is the trainer)", rank_offset, int, 1, world_size - 1)
        group_name = _field(body, "group_name", str, "weight_update_group")
        backend = _field(body, "backend", str, "nccl")
        if not group_name:
            raise BadRequest("group_name must be a non-empty string")
        if backend not in ("nccl", "gloo"):
            raise BadRequest(f"backend must be 'nccl' or 'gloo', got {short_repr(backend)}")
        if group_name in server.groups:
            return web.json_response({"success": False, "message": f"group {group_name!r} already exists; "
                                      f"destroy it first"}, status=400)
        if backend == "nccl" and runner.device.type == "cpu":
            backend = "gloo"  # NCCL cannot move CPU tensors; a CPU server always takes part over gloo.
        from lib.process_group import destroy_custom_process_group, init_custom_process_group

        timeout_s = server.args.weight_sync_timeout_s
        async with server.one_group_op(f"joining group {group_name!r} at {addr}:{port}"):
            # Blocks until the trainer joins, off the event loop and off the model thread. torch's own
            # timeout does not cover the store's first reply, so the wait is bounded here too.
            joined = _on_daemon_thread(lambda: init_custom_process_group(
                backend, f"tcp://{addr}:{port}", world_size, rank_offset, group_name, timeout_s=timeout_s))
            try:
                server.groups[group_name] = await asyncio.wait_for(asyncio.shield(joined), timeout_s)
            except asyncio.TimeoutError:
                def leave_late_group(done):  # a join that succeeds after we answered must not stay
                    if done.exception() is None:
                        destroy_custom_process_group(done.result())
                joined.add_done_callback(leave_late_group)
                return web.json_response({"success": False, "message": f"Failed to initialize custom process group: "
                                          f"nothing at {addr}:{port} answered as the trainer's store within "
                                          f"--weight-sync-timeout-s {timeout_s} s."}, status=400)
            except Exception as e:
                return web.json_response({"success": False,
                                          "message": f"Failed to initialize custom process group: {e}."}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def update_weights_from_distributed(request):
        body = await _json_body(request, allow_empty=False)
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        group_name = _field(body, "group_name", str, "weight_update_group")
        load_format = _field(body, "load_format", str)
        version = _field(body, "weight_version", str)
        abort_all = _field(body, "abort_all_requests", bool, False)
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes)):
            raise BadRequest("names, dtypes and shapes must be lists of equal length")
        if load_format not in (None, "flattened_bucket"):
            raise BadRequest(f"load_format {short_repr(load_format)} is not supported; use null or 'flattened_bucket'")
        if not all(isinstance(n, str) for n in names):
            raise BadRequest("names must be strings (Hugging Face state-dict names)")
        if not all(isinstance(s, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in s) for s in shapes):
            raise BadRequest("shapes must be lists of integers")
        torch_dtypes = [_parse_dtype(d) for d in dtypes]
        if group_name not in server.groups:
            return web.json_response({"success": False, "message": f"Group {group_name} not in "
                                      f"{list(server.groups)}. Please call `init_weights_update_group` first."},
                                     status=400)
        try:  # everything is checked before the first byte is received
            runner.check_named_shapes(names, shapes)
        except BadRequest as e:
            return web.json_response({"success": False, "message": f"Failed to update parameter online: {e}."},
                                     status=400)
        pg = server.groups[group_name]

        def receive():
            import torch.distributed as dist

            device = runner.device
            if load_format == "flattened_bucket":
                # SGLang's FlattenedTensorBucket: each tensor's bytes (tensor.flatten().view(uint8)),
                # concatenated in order, sent as one uint8 broadcast; mixed dtypes allowed.
                nbytes = [math.prod(s) * torch.empty(0, dtype=d).element_size() for s, d in zip(shapes, torch_dtypes)]
                flat = torch.empty(sum(nbytes), dtype=torch.uint8, device=device)
                dist.broadcast(flat, src=0, group=pg)
                # clone: a slice's byte offset need not be aligned to its dtype, which view(dtype) requires
                return [(n, part.clone().view(d).view(s)) for n, part, d, s in zip(names, flat.split(nbytes), torch_dtypes, shapes)]
            tensors = [torch.empty(s, dtype=d, device=device) for s, d in zip(shapes, torch_dtypes)]
            handles = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in tensors]
            for h in handles:
                h.wait()
            return list(zip(names, tensors))
        async with server.one_group_op(f"receiving {len(names)} tensors on group {group_name!r}"):
            try:
                async with server.exclusive_update(abort_all):
                    # Received off the model thread (paused in-place rows and the event loop carry on),
                    # then copied in one go between steps: no forward ever sees half-updated weights.
                    named = await asyncio.get_running_loop().run_in_executor(server.group_worker, receive)
                    await server.run_on_worker(runner.copy_named_tensors, named)
            except Exception as e:
                return web.json_response({"success": False, "message": f"Failed to update parameter online: {e}."},
                                         status=400)
        if version is not None:
            server.weight_version = version
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def destroy_weights_update_group(request):
        body = await _json_body(request, allow_empty=False)
        group_name = _field(body, "group_name", str, "weight_update_group")
        pg = server.groups.pop(group_name, None)
        if pg is None:
            return web.json_response({"success": False, "message": "The group to be destroyed does not exist."},
                                     status=400)
        from lib.process_group import destroy_custom_process_group

        await asyncio.get_running_loop().run_in_executor(None, destroy_custom_process_group, pg)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    return [web.post("/init_weights_update_group", _finish_even_if_client_leaves(init_weights_update_group)),
            web.post("/update_weights_from_distributed", _finish_even_if_client_leaves(update_weights_from_distributed)),
            web.post("/destroy_weights_update_group", _finish_even_if_client_leaves(destroy_weights_update_group))]


def _lora_routes(server: Server) -> list:
    """LoRA adapters by name: SGLang's /load_lora_adapter and /unload_lora_adapter (LoRAUpdateOutput answers)."""
    adapters = server.runner.adapters

    def answer(error: str | None = None) -> web.Response:
        return web.json_response({"success": error is None, "error_message": error or "",
                                  "loaded_adapters": adapters.paths()}, status=400 if error else 200)

    async def load_lora_adapter(request):
        from lib.lora_serving import read_adapter

        body = await _json_body(request, allow_empty=False)
        name = _field(body, "lora_name", str, required=True)
        path = _field(body, "lora_path", str, required=True)
        _field(body, "pinned", bool, False)  # nothing is evicted here: checked, no effect
        if not name:
            raise BadRequest("lora_name must be a non-empty string")
        try:  # read and checked off the event loop; then added between two model steps
            adapter = await asyncio.get_running_loop().run_in_executor(
                None, read_adapter, name, path, server.runner.model, server.runner.max_checkpoint_bytes)
            await server.run_on_worker(adapters.load, adapter)
        except BadRequest as e:
            logger.warning("load_lora_adapter(%r, %r) failed: %s", name, path, e)
            return answer(f"Failed to load LoRA adapter {name!r}: {e}")
        logger.info("loaded LoRA adapter %r from %s", name, path)
        return answer()

    async def unload_lora_adapter(request):
        body = await _json_body(request, allow_empty=False)
        name = _field(body, "lora_name", str, required=True)
        try:
            adapters.unload(name)
        except BadRequest as e:
            return answer(str(e))
        return answer()

    return [web.post("/load_lora_adapter", _finish_even_if_client_leaves(load_lora_adapter)),
            web.post("/unload_lora_adapter", unload_lora_adapter)]


def build_app(server: Server) -> web.Application:
    app = web.Application(client_max_size=int(server.args.max_body_mb * 2**20),
                          middlewares=[errors_as_json(_error, logger)])
    app[MAX_BODY_BYTES] = int(server.args.max_body_mb * 2**20)
    app[BODY_TIMEOUT_S] = server.args.body_timeout_s
    app.add_routes(_generation_routes(server) + _info_routes(server) + _control_routes(server)
                   + _weight_routes(server) + _weight_group_routes(server) + _lora_routes(server))

    async def on_startup(app):
        app[SCHEDULER_TASK] = asyncio.create_task(server.scheduler())

    async def on_cleanup(app):
        app[SCHEDULER_TASK].cancel()
        for executor in (server.worker, server.tokenizer_worker, server.group_worker):
            executor.shutdown(wait=False, cancel_futures=True)

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="HF-format model directory")
    p.add_argument("--tokenizer-path", default=None, help="defaults to --model-path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="cpu", help="cpu or cuda (or cuda:N)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
                   help="auto: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--max-running-requests", type=int, default=32, help="rows decoded together at most")
    p.add_argument("--max-prefill-tokens", type=int, default=16384,
                   help="bound on (rows x padded length) of one prefill forward; one request always fits")
    p.add_argument("--context-length", type=int, default=None, help="defaults to max_position_embeddings")
    p.add_argument("--allow-auto-truncate", action="store_true",
                   help="cap max_new_tokens so prompt + output fits the context (finish_reason length) "
                        "instead of refusing the request with a 400, as SGLang does by default")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--weight-version", default="default", help="initial weight_version reported in meta_info")
    p.add_argument("--request-timeout-s", type=float, default=3600.0,
                   help="a request still running after this long is aborted (finish_reason abort)")
    p.add_argument("--max-body-mb", type=float, default=64.0, help="larger request bodies get a 413")
    p.add_argument("--body-timeout-s", type=float, default=60.0,
                   help="a request body not fully received this long after its headers gets a 408")
    p.add_argument("--health-timeout-s", type=float, default=20.0)
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="a streamed /generate sends each step's new tokens and text only (SGLang's flag); "
                        "default: the output so far, as SGLang does")
    p.add_argument("--weight-sync-timeout-s", type=float, default=600.0,
                   help="how long /init_weights_update_group and collectives wait for the trainer")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.random_seed)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    server = Server(args)
    logger.info("serving %s on http://%s:%d (device %s, dtype %s, context %d)", args.model_path, args.host,
                args.port, args.device, server.runner.dtype, server.runner.context_length)
    # handler_cancellation: a client that disconnects cancels its handler, so its rows are freed
    web.run_app(build_app(server), host=args.host, port=args.port, print=None, access_log=None,
                handler_cancellation=True)


if __name__ == "__main__":
    main()
