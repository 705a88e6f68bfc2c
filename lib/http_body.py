"""A request's JSON body for our servers (the CPU inference server, the retrieval server), with every
way a body can be bad answered by a 4xx that names the cause, never a 5xx or a held socket; and the
middleware that turns a handler's failure into such a JSON answer."""
import asyncio
import json
import logging
import re
import sys
from typing import Callable

from aiohttp import web


class BadRequest(ValueError):
    """A request the client must fix; answered with `status` (400 unless said) and the message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def errors_as_json(error: Callable[[int, str], web.Response], logger: logging.Logger, routes_hint: str = ""):
    """An aiohttp middleware that answers a handler's failure with `error(status, message)`: a
    BadRequest with its status (a 408 also closes the connection, so the rest of that body is not
    waited for), aiohttp's own 4xx/5xx (unknown path, wrong method) with its reason and `routes_hint`,
    and anything else with a 500 whose traceback goes to `logger`."""
    @web.middleware
    async def middleware(request, handler):
        try:
            return await handler(request)
        except BadRequest as e:
            response = error(e.status, str(e))
            if e.status == 408:
                response.force_close()
            return response
        except RecursionError:  # JSON nested deeper than the parser (or a later check) can follow
            return error(400, "the JSON body is nested too deeply")
        except web.HTTPException as e:
            if e.status >= 400:
                return error(e.status, f"{e.reason}: {request.method} {request.path}; {routes_hint}" if routes_hint
                             else e.reason)
            raise
        except ConnectionResetError:  # the client left while its body was read: no one to answer or to blame
            return error(400, "the connection was lost before the whole request body arrived")
        except Exception as e:
            logger.exception("%s %s failed", request.method, request.path)
            return error(500, f"internal error: {e!r}")
    return middleware


async def read_json_body(request: web.Request, *, max_body_bytes: int, timeout_s: float, too_large_hint: str,
                         allow_empty: bool = False, parse_constant=None):
    """The parsed JSON body, or BadRequest: over `max_body_bytes` (413, with `too_large_hint`), not
    all there within `timeout_s` (408), not readable as its Content-Encoding says, or not JSON that
    Python parses (400: invalid, nested ~1000 levels deep, an integer over 4300 digits). A blank body
    is `{}` with `allow_empty`, else a 400. `parse_constant` sees NaN/Infinity literals."""
    raw = await read_body(request, max_body_bytes=max_body_bytes, timeout_s=timeout_s, too_large_hint=too_large_hint)
    return parse_json_body(raw, allow_empty=allow_empty, parse_constant=parse_constant)


async def read_body(request: web.Request, *, max_body_bytes: int, timeout_s: float, too_large_hint: str) -> bytes:
    """The raw body, or read_json_body's BadRequest for a body too large, too slow or unreadable."""
    try:
        # Without a deadline, a client that sends part of a body and goes silent holds its connection
        # (a file descriptor) for good; so does a deflate body cut short, sent after its headers
        # (aiohttp then never ends the payload).
        return await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise BadRequest(f"the request body was not all read within {timeout_s} s; send it at once, check "
                         "its Content-Encoding, or raise the server's --body-timeout-s", 408)
    except web.HTTPRequestEntityTooLarge:
        raise body_too_large(max_body_bytes, too_large_hint)
    except web.RequestPayloadError as e:  # e.g. `Content-Encoding: gzip` on a body that is not gzip
        raise BadRequest(f"the request body could not be read ({' '.join(str(e).split())}); send plain JSON, "
                         f"or JSON encoded as its Content-Encoding {request.headers.get('Content-Encoding')!r} says")


def body_too_large(max_body_bytes: int, hint: str) -> BadRequest:
    """The 413 for a body over `max_body_bytes` (also raised by transports that read the body themselves)."""
    return BadRequest(f"request body larger than {max_body_bytes} bytes; {hint}", 413)


def parse_json_body(raw: bytes, *, allow_empty: bool = False, parse_constant=None):
    """read_json_body's parsing of a body already read (the OpenAI proxy's in-process transport)."""
    if not raw.strip():
        if not allow_empty:
            raise BadRequest("empty body; send a JSON object")
        return {}
    try:
        return json.loads(raw, parse_constant=parse_constant)
    except RecursionError:
        raise BadRequest("the body nests arrays or objects too deeply to parse (about 1000 levels)")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not valid JSON ({e})")
    except ValueError as e:  # an integer literal longer than sys.get_int_max_str_digits()
        raise BadRequest(f"the body holds an integer that cannot be read ({str(e).split(';')[0]}); "
                         f"integers may have at most {sys.get_int_max_str_digits()} digits")


# json.loads joins a valid \ud83d\ude00 pair into one character, so a surrogate left in a string is a
# lone one: not text (UTF-8 cannot carry it, tokenizers raise on it).
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def lone_surrogate(value, field: str = "") -> tuple[str, str, int] | None:
    """The first string in a parsed JSON value that holds a lone surrogate, as (its field: `text[1]`,
    `sampling_params.stop[0]`, `a field name in rid`..., or "the body" for `value` itself; the
    string; the surrogate's index), or None when every string is text. Walked without recursion."""
    stack = [(value, field)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and (found := _SURROGATE.search(item)):
                return where or "the body", item, found.start()
        elif isinstance(item, list):
            stack.extend((x, f"{where}[{i}]") for i, x in reversed(list(enumerate(item))))
        elif isinstance(item, dict):
            for key, x in reversed(list(item.items())):
                stack += [(x, f"{where}.{key}" if where else key), (key, f"a field name in {where or 'the body'}")]
    return None
