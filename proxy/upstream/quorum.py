"""Network mode's agreement (DESIGN §6): what replicas must agree on, and the verdict. No I/O.

A network-mode request runs on R distinct backends (`Pool.pick_distinct`, then
`proxy.upstream.redundant.run_redundant`); each answer is reduced to a fingerprint, a sha256 hex
of only what must agree, and the answer is returned when at least `quorum` replicas' fingerprints
are equal and no other group is as large:

    chat completion (OpenAI shape)   per choice: message.content, its tool calls (function name
                                     and arguments, as JSON), finish_reason; ids, timestamps,
                                     usage, logprobs and system_fingerprint do not count
    bytes (audio, image, video)      sha256 of the bytes themselves
    ASR answer ({"text": ...})       the text, lower case, whitespace runs as one space
    anything else                    its JSON, keys sorted

`task_address` names one redundant execution: a stable 64-hex digest of the request id, the
model and the replicas' fingerprints, pollable like a task id.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import orjson

T = TypeVar("T")

FAILED = ""  # the fingerprint recorded for a replica that failed or sent an unusable answer
_JSON = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS


def _digest(tag: str, value: object) -> str:
    """sha256 of a tagged canonical JSON: a chat answer and an equal-looking dict never meet."""
    return hashlib.sha256(orjson.dumps([tag, value], option=_JSON)).hexdigest()


def fingerprint(answer: object) -> str:
    """A stable sha256 hex of what replicas must agree on in `answer` (see the module doc)."""
    if isinstance(answer, bytes | bytearray | memoryview):
        return hashlib.sha256(answer).hexdigest()
    if isinstance(answer, dict):
        choices = answer.get("choices")
        if isinstance(choices, list):
            return _digest("chat", _chat_choices(choices))
        text = answer.get("text")
        if isinstance(text, str):
            return _digest("text", " ".join(text.split()).lower())
    return _digest("json", answer)


def _chat_choices(choices: list[Any]) -> list[object]:
    ordered = sorted((c for c in choices if isinstance(c, dict)), key=_choice_index)
    out: list[object] = []
    for choice in ordered:
        message = choice.get("message")
        message = message if isinstance(message, dict) else {}
        calls = message.get("tool_calls")
        out.append([message.get("content"),
                    [_tool_call(call) for call in calls] if isinstance(calls, list) else None,
                    choice.get("finish_reason")])
    return out


def _choice_index(choice: dict[str, Any]) -> int:
    index = choice.get("index")
    return index if isinstance(index, int) else 0


def _tool_call(call: object) -> object:
    """A tool call's function name and arguments; arguments that are JSON compare as JSON, so
    `{"a":1}` and `{"a": 1}` are the same call. Its `id` is random per server: left out."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return None
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = ["json", orjson.loads(arguments)]
        except orjson.JSONDecodeError:
            arguments = ["text", arguments]
    return [function.get("name"), arguments]


@dataclass
class Verdict(Generic[T]):
    """The outcome of one redundant execution.

    `backends` and `fingerprints` list every replica in the order run (a failed replica's
    fingerprint is `FAILED`, ""); `agreeing` is the size of the largest group of equal answers
    (the winner's when there is one; a tie has none); `answer` is the winning group's first
    answer, None without a winner.
    """

    answer: T | None
    agreeing: int
    replicas: int
    quorum: int
    fingerprints: list[str]
    backends: list[str]
    # The winning fingerprint; None when no group reached the quorum alone.
    winner: str | None = None
    # (backend name, exception) for each replica that failed or sent an unusable answer.
    failures: list[tuple[str, BaseException]] = field(default_factory=list)

    @property
    def agreed(self) -> bool:
        return self.winner is not None

    @property
    def agreeing_backends(self) -> list[str]:
        """The backends whose answers make up the winning group ([] without a winner)."""
        if self.winner is None:
            return []
        return [b for b, f in zip(self.backends, self.fingerprints, strict=True)
                if f == self.winner]


def decide(results: Sequence[tuple[str, T | BaseException]], key: Callable[[T], str],
           quorum: int) -> Verdict[T]:
    """Group the replicas' answers by `key` (a fingerprint); the largest group wins if it has at
    least `quorum` members and no other group is as large. A failure (an exception, or an answer
    `key` cannot fingerprint) agrees with nothing."""
    if quorum < 1:
        raise ValueError(f"quorum must be at least 1, got {quorum}")
    fingerprints: list[str] = []
    failures: list[tuple[str, BaseException]] = []
    first: dict[str, T] = {}
    for name, result in results:
        if isinstance(result, BaseException):
            failures.append((name, result))
            fingerprints.append(FAILED)
            continue
        try:
            mark = key(result)
        except Exception as exc:  # an answer that cannot be fingerprinted is unusable
            failures.append((name, exc))
            fingerprints.append(FAILED)
            continue
        fingerprints.append(mark)
        first.setdefault(mark, result)
    groups = Counter(f for f in fingerprints if f != FAILED).most_common(2)
    agreeing = groups[0][1] if groups else 0
    winner = None
    if groups and agreeing >= quorum and (len(groups) == 1 or groups[1][1] < agreeing):
        winner = groups[0][0]
    return Verdict(
        answer=first[winner] if winner is not None else None,
        agreeing=agreeing,
        replicas=len(fingerprints),
        quorum=quorum,
        fingerprints=fingerprints,
        backends=[name for name, _ in results],
        winner=winner,
        failures=failures,
    )


def task_address(request_id: str, model: str, fingerprints: Sequence[str]) -> str:
    """The stable 64-hex identifier of one redundant execution: the same request id, model and
    replica fingerprints (in any order) always give the same address."""
    canonical = orjson.dumps(["network", request_id, model, sorted(fingerprints)])
    return hashlib.sha256(canonical).hexdigest()
