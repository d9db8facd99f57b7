"""The nginx upstream mock: fixed, valid vLLM-style answers, sent at once. Pure except `write_conf`.

nginx answers `POST /v1/chat/completions` with one of two fixed bodies, chosen by the request's
`Accept` header, which the gateway sets itself on every upstream call (`text/event-stream` for a
streamed request, `application/json` otherwise) and the load generator sends on direct requests.
The gateway therefore forwards nothing extra and does its whole policy path as usual; only the
upstream's work is taken out of the figure.

Non-streamed: one `chat.completion` object (the content is `COMPLETION_TOKENS` words) with `usage`.

The same answers under `SLOW_PREFIX` (`/slow/v1/chat/completions`, `/slow/health`), except that a
stream sends its role chunk and first token at once and then trickles at `SLOW_RATE` bytes/s
(nginx `limit_rate`): the open-streams phase holds a thousand of those for next to no CPU.

Streamed: exactly `STREAM_EVENTS` = 52 SSE events, as vLLM sends them when the request asks for
`stream_options.include_usage` (the gateway always asks; the load generator asks too, so the
gateway relays the usage chunk and both sides receive the same 52 events):

    1   role chunk       delta {"role": "assistant", "content": ""}
    48  content chunks   delta {"content": " <word>"}, one word (token) each
    1   finish chunk     delta {}, finish_reason "stop"
    1   usage chunk      choices [], usage {prompt 12, completion 48, total 60}
    1   data: [DONE]
"""

from __future__ import annotations

import json
from pathlib import Path

MODEL = "acme/small-chat"
SLOW_PREFIX = "/slow"  # the trickling copy: a backend URL ending in it gets slow streams
SLOW_RATE = 64  # bytes/s after the first token: one event every ~3 s, the whole stream ~3 min
COMPLETION_TOKENS = 48
PROMPT_TOKENS = 12
STREAM_EVENTS = 1 + COMPLETION_TOKENS + 1 + 1 + 1  # role, tokens, finish, usage, [DONE] = 52
COMPLETION_ID = "chatcmpl-bench00000000000000000000000000"
CREATED = 1_767_225_600

_WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed",
          "do", "eiusmod", "tempor", "incididunt", "ut", "labore", "et")
# nginx reads its config in 4 KiB buffers and refuses a longer single parameter; the stream body
# is ~10 KiB, so it is split over several variables, each well under that.
_NGINX_PART_CHARS = 3000


def tokens() -> list[str]:
    return [" " + _WORDS[i % len(_WORDS)] for i in range(COMPLETION_TOKENS)]


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def usage() -> dict[str, int]:
    return {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS,
            "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS}


def completion_body(model: str = MODEL) -> bytes:
    """The non-streamed answer."""
    return (_dumps({
        "id": COMPLETION_ID, "object": "chat.completion", "created": CREATED, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(tokens())},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": usage(),
    }) + "\n").encode()


def stream_events(model: str = MODEL) -> list[bytes]:
    """The data of each of the `STREAM_EVENTS` events, in order (the last is `[DONE]`)."""
    def chunk(delta: dict[str, str], finish: str | None = None) -> str:
        return _dumps({
            "id": COMPLETION_ID, "object": "chat.completion.chunk", "created": CREATED,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        })

    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": token}) for token in tokens()]
    events.append(chunk({}, "stop"))
    events.append(_dumps({"id": COMPLETION_ID, "object": "chat.completion.chunk",
                          "created": CREATED, "model": model, "choices": [],
                          "usage": usage()}))
    events.append("[DONE]")
    assert len(events) == STREAM_EVENTS
    return [event.encode() for event in events]


def stream_body(model: str = MODEL) -> bytes:
    return b"".join(b"data: " + data + b"\n\n" for data in stream_events(model))


def _nginx_string(text: str) -> str:
    """A double-quoted nginx string: `\\`, `"` and newlines escaped; `$` would be a variable."""
    if "$" in text:
        raise ValueError("a `$` would be read as an nginx variable")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _parts(body: bytes) -> list[str]:
    """The body as nginx strings of at most `_NGINX_PART_CHARS` characters, split between
    events (so each part is easy to read in the generated file)."""
    parts: list[str] = []
    current = ""
    for event in body.decode().split("\n\n")[:-1]:
        piece = event + "\n\n"
        if current and len(_nginx_string(current + piece)) > _NGINX_PART_CHARS:
            parts.append(_nginx_string(current))
            current = ""
        current += piece
    if current:
        parts.append(_nginx_string(current))
    return parts


def _stream_location(name: str, model: str, extra: str = "") -> str:
    sse = _parts(stream_body(model))
    sets = "\n".join(f"            set $sse{i} {part};" for i, part in enumerate(sse))
    joined = "".join(f"$sse{i}" for i in range(len(sse)))
    return f"""\
        location = /_mock/{name} {{
            internal;
            default_type text/event-stream;
{extra}{sets}
            return 200 "{joined}";
        }}"""


def _chat_locations(prefix: str, name: str, model: str, extra: str = "") -> str:
    return f"""\
        location = {prefix}/health {{
            default_type text/plain;
            return 200 "";
        }}
        location = {prefix}/v1/chat/completions {{
            if ($request_method != POST) {{
                return 405;
            }}
            if ($http_accept ~ "text/event-stream") {{
                rewrite ^ /_mock/{name}_stream last;
            }}
            rewrite ^ /_mock/{name}_completion last;
        }}
        location = /_mock/{name}_completion {{
            internal;
            default_type application/json;
            return 200 {_nginx_string(completion_body(model).decode())};
        }}
{_stream_location(name + "_stream", model, extra)}"""


def nginx_conf(folder: Path, *, port: int, model: str = MODEL, slow_model: str = MODEL,
               max_connections: int = 8192) -> str:
    """A complete nginx.conf: foreground, one worker, no access log, every path inside `folder`."""
    paths = "\n".join(f"    {name}_temp_path {json.dumps(str(folder / name))};"
                      for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    # The role chunk and the first token go at once (plus headers); the rest trickles.
    first = sum(len(b"data: " + data + b"\n\n") for data in stream_events(slow_model)[:2])
    trickle = (f"            limit_rate {SLOW_RATE};\n"
               f"            limit_rate_after {first + 256};\n")
    return f"""\
# Generated by loadtests/mock.py: the benchmark's upstream mock. See that module's docstring.
daemon off;
master_process on;
worker_processes 1;
worker_rlimit_nofile {2 * max_connections + 64};
pid {json.dumps(str(folder / "nginx.pid"))};
error_log {json.dumps(str(folder / "error.log"))} warn;

events {{
    worker_connections {max_connections};
}}

http {{
    access_log off;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    send_timeout 300s;
    client_max_body_size 16m;
    client_body_buffer_size 64k;
{paths}

    server {{
        listen 127.0.0.1:{port} backlog=4096;

{_chat_locations("", "fast", model)}
{_chat_locations(SLOW_PREFIX, "slow", slow_model, trickle)}
        # An OTLP/HTTP sink for the gateway's traces (loadtests.paired --tracing).
        location = /v1/traces {{
            default_type application/x-protobuf;
            return 200 "";
        }}
    }}
}}
"""


def write_conf(folder: Path, *, port: int, model: str = MODEL, slow_model: str = MODEL,
               max_connections: int = 8192) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "nginx.conf"
    path.write_text(nginx_conf(folder, port=port, model=model, slow_model=slow_model,
                               max_connections=max_connections))
    return path
