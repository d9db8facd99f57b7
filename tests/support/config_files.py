"""Config as an operator writes it, for tests: the model the simulators serve, tier tables
(generous ones for tests not about limits, `tiers()` at chosen rates), TOML values, and a config
folder (backends.toml plus policies/*.toml)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

MODEL = "acme/small-chat"

# Tests that are not about rate limits must not trip over them.
GENEROUS_TIERS = """
[tiers.guest]
requests_per_minute = 100000
families = ["chat", "tts", "asr", "image", "video", "embed"]
models = { "*" = ["direct", "network"] }

[tiers.max]
requests_per_minute = 100000
families = ["chat", "tts", "asr", "image", "video", "embed"]
models = { "*" = ["direct", "network"] }
"""

BIG = "acme/gpt-oss-120b"  # the one model of `tiers()`'s large-chat group


def tiers(guest: int = 100, basic: int = 100, pro: int = 100, max_: int = 100,
          guest_store_down: str = "open", basic_store_down: str = "closed") -> str:
    """The four tiers at the given requests per minute; `large-chat` (BIG) is pro's and max's."""
    return f"""
[groups]
large-chat = ["{BIG}"]

[tiers.guest]
requests_per_minute = {guest}
families = ["chat"]
models = {{ "*" = ["direct", "network"] }}
max_tokens_per_request = 64
store_down = "{guest_store_down}"
fallback_requests_per_minute = 2

[tiers.basic]
requests_per_minute = {basic}
families = ["chat", "tts", "asr"]
models = {{ standard = ["direct", "network"] }}
store_down = "{basic_store_down}"

[tiers.pro]
requests_per_minute = {pro}
families = ["chat", "tts", "asr", "image"]
models = {{ standard = ["direct", "network"], large-chat = ["direct"] }}

[tiers.max]
requests_per_minute = {max_}
families = ["chat", "tts", "asr", "image", "video", "embed"]
models = {{ standard = ["direct", "network"], large-chat = ["direct", "network"] }}
"""


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(value)


def write_config(
    folder: Path,
    backends: list[dict[str, Any]],
    *,
    upstream: dict[str, Any] | None = None,
    gateway: dict[str, Any] | None = None,
    server: dict[str, Any] | None = None,
    policies: dict[str, str] | None = None,
    media: dict[str, Any] | None = None,
    routing: dict[str, Any] | None = None,
    alerts: dict[str, Any] | None = None,
    telemetry: dict[str, Any] | None = None,
) -> Path:
    """A config folder as an operator writes it: backends.toml plus policies/*.toml."""
    lines = ["[gateway]"] + [f"{k} = {toml_value(v)}" for k, v in (gateway or {}).items()]
    lines += ["", "[upstream]"] + [f"{k} = {toml_value(v)}" for k, v in (upstream or {}).items()]
    for name, table in (("server", server), ("routing", routing), ("media", media),
                        ("alerts", alerts), ("telemetry", telemetry)):
        if table:
            lines += ["", f"[{name}]"] + [f"{k} = {toml_value(v)}" for k, v in table.items()]
    for backend in backends:
        lines += ["", "[[backends]]"] + [f"{k} = {toml_value(v)}" for k, v in backend.items()]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "backends.toml").write_text("\n".join(lines) + "\n")
    (folder / "policies").mkdir(exist_ok=True)
    for name, text in (policies or {}).items():  # "shadow/tiers.toml": the shadow set's
        (folder / "policies" / name).parent.mkdir(exist_ok=True)
        (folder / "policies" / name).write_text(text)
    return folder
