"""`inference-gateway simulate KIND ...`: run one simulated upstream server."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from typing import Any

from proxy.simulators import KINDS, SimConfig, build_app
from proxy.simulators.config import KvEventsConfig

# The chat kinds listen where the real servers do. The media kinds' ports are this project's
# choice, apart from the usual 8000/8080 so they can run beside a vLLM: 8880 is Kokoro-FastAPI's
# and 8188 ComfyUI's.
DEFAULT_PORTS = {"tgi": 3000, "vllm": 8000, "tts": 8880, "whisper": 8178, "image": 8188,
                 "video": 8189, "tei": 3001}
DEFAULT_MODEL = "acme/small-chat"
DEFAULT_MODELS = {"tts": "acme/csm-1b", "whisper": "acme/whisper-large-v3",
                  "image": "acme/image-gen", "video": "acme/video-gen",
                  "tei": "acme/embed-small"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", choices=KINDS, help="which server to simulate")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help="default: 3000 tgi, 8000 vllm, 8880 tts, 8178 whisper, 8188 image, 8189 video, "
        "3001 tei",
    )
    parser.add_argument(
        "--model",
        action="append",
        dest="models",
        metavar="NAME",
        help=f"served model, repeatable (default {DEFAULT_MODEL}; tts {DEFAULT_MODELS['tts']}, "
        f"whisper {DEFAULT_MODELS['whisper']}, image {DEFAULT_MODELS['image']}, video "
        f"{DEFAULT_MODELS['video']}, tei {DEFAULT_MODELS['tei']}); TGI and TEI serve the "
        "first only",
    )
    parser.add_argument(
        "--ttft-ms", type=float, default=0.0,
        help="time to first token, milliseconds (media kinds: processing time)"
    )
    parser.add_argument(
        "--tokens-per-s",
        type=float,
        default=0.0,
        help="decode speed; 0 sends tokens as fast as possible",
    )
    parser.add_argument(
        "--max-concurrency", "--max-num-seqs", "--max-concurrent-requests", type=_positive_int,
        default=128, dest="max_concurrency", metavar="N",
        help="vLLM --max-num-seqs: the running batch, requests beyond it wait; TGI "
        "--max-concurrent-requests: 429 beyond it in flight; TEI: the same, counted in inputs",
    )
    parser.add_argument(
        "--speed", type=_positive_float, default=1.0,
        help="divides every latency (first token, prefill, token interval, media processing): "
        "0.33 is a replica three times slower",
    )
    parser.add_argument(
        "--prefill-ms-per-1k-tokens", type=_non_negative_float, default=0.0, metavar="MS",
        help="prefill time per 1000 prompt tokens not in the prefix cache; prefills run one at "
        "a time, before --ttft-ms",
    )
    parser.add_argument(
        "--kv-cache-blocks", "--num-gpu-blocks-override", type=_positive_int, default=65536,
        dest="kv_cache_blocks", metavar="N",
        help="KV-cache capacity in blocks of --block-size: running requests' blocks, then an "
        "LRU of cached prefix blocks",
    )
    parser.add_argument(
        "--startup-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="keep the port closed this long, like a server loading weights",
    )
    parser.add_argument(
        "--fail-generation", action="store_true", help="/health stays OK but every generation fails"
    )
    parser.add_argument(
        "--completion-tokens",
        type=int,
        default=16,
        help="natural completion length (x-sim-tokens overrides per request)",
    )
    vllm = parser.add_argument_group("vllm", "engine options named as `vllm serve` names them")
    vllm.add_argument("--max-model-len", type=int, default=32768,
                      help="the context: prompt + completion tokens")
    vllm.add_argument("--max-num-queued-reqs", type=int, default=None, dest="max_queued",
                      help="requests in flight (running and waiting) beyond which it answers 503")
    vllm.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                      help="priority: the waiting queue ordered by each request's `priority` "
                      "(lower first); fcfs refuses any priority but 0")
    vllm.add_argument("--enable-prompt-tokens-details", action="store_true",
                      help="report usage.prompt_tokens_details.cached_tokens")
    vllm.add_argument("--block-size", type=_positive_int, default=16,
                      help="KV-cache block: prompts that begin alike share cached blocks")
    vllm.add_argument("--runner", choices=("generate", "pooling"), default="generate",
                      help="pooling: an embedding model (/v1/embeddings; chat refused)")
    vllm.add_argument("--kv-events-config", type=_kv_events_config, default=None,
                      metavar="JSON",
                      help='publish KV-cache events as vLLM does, e.g. \'{"enable_kv_cache_'
                      'events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": '
                      '"kv"}\' (a ZMQ PUB socket, bound)')
    embeddings = parser.add_argument_group("tei, vllm --runner pooling")
    embeddings.add_argument("--embedding-size", type=_positive_int, default=384,
                            help="the model's vector length")
    embeddings.add_argument("--max-input-length", type=_positive_int, default=512,
                            help="tei: the model's longest input in tokens")
    embeddings.add_argument("--max-client-batch-size", type=_positive_int, default=32,
                            help="tei: most inputs in one request (422 beyond)")
    tgi = parser.add_argument_group("tgi", "router options named as TGI names them")
    tgi.add_argument("--max-batch-size", type=_positive_int, default=None,
                     help="the running batch; beyond it requests queue (default: "
                     "--max-concurrent-requests, so nothing queues); tei: requests processed "
                     "at once")
    tgi.add_argument("--max-batch-total-tokens", type=_positive_int, default=None, metavar="N",
                     help="the running batch's token budget (prompt + max new tokens each); "
                     "sets --kv-cache-blocks to N / --block-size")
    media = parser.add_argument_group("tts, whisper")
    media.add_argument("--voice", action="append", dest="voices", metavar="NAME",
                       help="tts: an accepted voice, repeatable (default: OpenAI's 11 voices "
                       "and CSM's 12 presets)")
    media.add_argument("--sample-rate", type=_sample_rate, default=24000,
                       help="tts: output sample rate (CSM: 24000; Piper: 22050)")
    media.add_argument("--word-timestamps", action="store_true",
                       help="whisper: answer timestamp_granularities[]=word with OpenAI's "
                       "top-level words (vLLM leaves them null)")
    media.add_argument("--whisper-cpp-errors-200", action="store_true",
                       help="whisper: /inference errors come with HTTP 200, as up to v1.8.x")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, not {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, not {text}")
    return value


def _kv_events_config(text: str) -> KvEventsConfig | None:
    from proxy.simulators import kv_events  # zmq: only once the option is given

    try:
        return kv_events.parse_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _kv_cache_blocks(args: argparse.Namespace) -> int:
    if args.max_batch_total_tokens is None:
        return int(args.kv_cache_blocks)
    return max(1, int(args.max_batch_total_tokens) // int(args.block_size))


def _sample_rate(text: str) -> int:
    rate = int(text)
    if not 1000 <= rate <= 384_000:
        raise argparse.ArgumentTypeError(f"a sample rate is 1000-384000 Hz, not {rate}")
    return rate


def config_from(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        models=tuple(args.models or (DEFAULT_MODELS.get(args.kind, DEFAULT_MODEL),)),
        ttft_ms=args.ttft_ms,
        tokens_per_s=args.tokens_per_s,
        max_concurrency=args.max_concurrency,
        max_batch_size=args.max_batch_size,
        startup_delay_s=args.startup_delay,
        fail_generation=args.fail_generation,
        default_completion_tokens=args.completion_tokens,
        max_model_len=args.max_model_len,
        max_queued=args.max_queued,
        scheduling_policy=args.scheduling_policy,
        prompt_tokens_details=args.enable_prompt_tokens_details,
        block_size=args.block_size,
        kv_cache_blocks=_kv_cache_blocks(args),
        prefill_ms_per_1k_tokens=args.prefill_ms_per_1k_tokens,
        speed=args.speed,
        voices=tuple(args.voices or ()),
        sample_rate=args.sample_rate,
        word_timestamps=args.word_timestamps,
        whisper_cpp_errors_200=args.whisper_cpp_errors_200,
        embedding_size=args.embedding_size,
        max_input_length=args.max_input_length,
        max_client_batch_size=args.max_client_batch_size,
        runner=args.runner,
        kv_events=args.kv_events_config,
    )


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(args: argparse.Namespace) -> int:
    # The server's imports here, not above: every command builds this parser.
    from aiohttp import web

    from proxy.simulators.state import STATE

    config = config_from(args)
    port = args.port if args.port is not None else DEFAULT_PORTS[args.kind]
    banner = (
        f"simulating {args.kind} on http://{args.host}:{port} serving {', '.join(config.models)}"
    )

    def announce(*_args: Any, **_kwargs: Any) -> None:
        print(banner, flush=True)

    app = build_app(args.kind, config)

    async def exit_server() -> None:
        # An engine death ends the server as it ends vLLM's: the port closes, the process exits.
        os.kill(os.getpid(), signal.SIGTERM)

    app[STATE].close_port = exit_server
    web.run_app(
        app,
        host=args.host,
        port=port,
        access_log=None,
        print=announce,
        handler_cancellation=True,  # a client disconnect stops generation at once
        loop=_new_loop(),
    )
    return 0
