"""Request validation with FastAPI/pydantic-v2 style 422 details.

Fast path: `msgspec.convert(body, schema)`, one compiled conversion; a valid body costs nothing
more. Slow path (only once msgspec has refused the body): walk the schema's `msgspec.inspect` type
info alongside the value and collect every fault as `{"loc", "msg", "type"}` worded as pydantic v2
words them, since FastAPI-style clients and the spec's 422 table expect that shape. The walker is
generic over type info, so every schema gets the same errors without per-field code; where it has
no opinion (a type it does not model) msgspec's own message is used, so a refusal always has items.
"""

import contextlib
import math
import re
import types
from collections.abc import Callable
from functools import cache
from typing import Any, Final, Literal, TypeVar, cast, get_args, get_origin

import msgspec
from msgspec import inspect as mi

__all__ = [
    "MAX_ERRORS",
    "ErrorItem",
    "Loc",
    "RequestInvalid",
    "conform",
    "conform_with",
    "schema_errors",
    "validate",
    "validate_with",
    "value_error",
    "whole_numbers",
]

T = TypeVar("T")
B = TypeVar("B")  # a decoded JSON body
Loc = tuple[str | int, ...]
ErrorItem = dict[str, object]

# A 1 MB body of wrong list items would otherwise produce ~500k items: cap the answer instead.
MAX_ERRORS: Final = 100
_FLOAT_OVERFLOW: Final = 2**1024 - 2**970  # the smallest int that float() refuses


class RequestInvalid(Exception):
    """The body failed the schema or a usage rule; `detail` is the spec's 422 list."""

    def __init__(self, detail: list[ErrorItem]) -> None:
        super().__init__(f"{len(detail)} validation error(s)")
        self.detail = detail


def validate(body: object, schema: type[T]) -> T:
    """Convert a decoded JSON body into `schema`, or raise RequestInvalid with every fault."""
    return conform(body, schema)[0]


def conform(body: B, schema: type[T]) -> tuple[T, B]:
    """`validate`, and the body that passed: `body` itself, or (when it had 1.0 where an
    integer is due) a copy with such numbers as ints, which is what to send on."""
    try:
        return msgspec.convert(body, schema), body
    except msgspec.ValidationError as exc:
        error = exc
    # JSON (and JSON Schema, which the OpenAPI document speaks) has one number 1 = 1.0; msgspec
    # refuses 1.0 for an int. Only for bodies that fail, so the fast path stays one conversion.
    whole = whole_numbers(body)
    if whole is not body:
        try:
            return msgspec.convert(whole, schema), whole
        except msgspec.ValidationError as exc:
            error = exc
    raise RequestInvalid(_explain(whole, schema, error)) from None


def whole_numbers(value: B) -> B:
    """`value` with every integral float (within 64 bits) as an int; `value` itself if none is.

    Both ends exclusive: orjson reads a JSON integer beyond 64 bits as the nearest float, which
    is ±2**63 itself for the first ones out of range, and those must stay refused."""
    return cast(B, _whole(value))


def _whole(value: object) -> object:
    if isinstance(value, float):
        return int(value) if value.is_integer() and -(2**63) < value < 2**63 else value
    if isinstance(value, dict):
        items = {k: _whole(v) for k, v in value.items()}
        changed = any(items[k] is not v for k, v in value.items())
        return items if changed else value
    if isinstance(value, list):
        elements = [_whole(v) for v in value]
        changed = any(new is not old for new, old in zip(elements, value, strict=True))
        return elements if changed else value
    return value


def validate_with(body: object, schema: type[T], rules: Callable[[T], list[ErrorItem]]) -> T:
    """Schema first, then the usage rules (which need a well-typed request to run)."""
    return conform_with(body, schema, rules)[0]


def conform_with(body: B, schema: type[T], rules: Callable[[T], list[ErrorItem]]
                 ) -> tuple[T, B]:
    """`validate_with`, and the body that passed (see `conform`)."""
    request, passed = conform(body, schema)
    faults = rules(request)
    if faults:
        raise RequestInvalid(faults)
    return request, passed


def value_error(loc: Loc, text: str) -> ErrorItem:
    """A usage-rule fault in pydantic's words."""
    return {"loc": list(loc), "msg": f"Value error, {text}", "type": "value_error"}


# ---- slow path ------------------------------------------------------------------------------


class _Full(Exception):
    """Raised by _Errors once the cap is reached, to stop walking a huge bad body."""


Orders = dict[frozenset[object], tuple[object, ...]]


class _Errors:
    __slots__ = ("items", "limit", "orders")

    def __init__(self, limit: int, orders: Orders) -> None:
        self.items: list[tuple[Loc, str, str]] = []
        self.limit = limit
        self.orders = orders

    def add(self, loc: Loc, kind: str, msg: str) -> None:
        self.items.append((loc, msg, kind))
        if len(self.items) >= self.limit:
            raise _Full


@cache
def _info(schema: Any) -> tuple[mi.Type, Orders]:
    return mi.type_info(schema), _literal_orders(schema)


def _literal_orders(schema: Any) -> Orders:
    """Literal values in declaration order: type info sorts them, pydantic lists them as written."""
    orders: Orders = {}
    seen: set[type] = set()

    def walk(hint: Any) -> None:
        if get_origin(hint) is Literal:
            orders.setdefault(frozenset(get_args(hint)), get_args(hint))
        elif isinstance(hint, type) and issubclass(hint, msgspec.Struct):
            if hint not in seen:
                seen.add(hint)
                for f in msgspec.structs.fields(hint):
                    walk(f.type)
        else:
            for arg in get_args(hint):
                walk(arg)

    walk(schema)
    return orders


def schema_errors(body: object, schema: Any, *, limit: int = MAX_ERRORS) -> list[ErrorItem]:
    """Every schema fault of `body` (at most `limit`), in field order; [] if it sees none."""
    info, orders = _info(schema)
    out = _Errors(limit, orders)
    with contextlib.suppress(_Full, RecursionError):
        _check(info, body, ("body",), out)
    return [{"loc": list(loc), "msg": msg, "type": kind} for loc, msg, kind in out.items]


_MSGSPEC_AT = re.compile(r"^(.*?) - at (?:`key` in )?`\$([^`]*)`$", re.DOTALL)
_PATH_PART = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def _explain(body: object, schema: Any, exc: msgspec.ValidationError) -> list[ErrorItem]:
    errors = schema_errors(body, schema)
    if errors:
        return errors
    # The walker had no opinion: report msgspec's own verdict at the path it names.
    text, loc = str(exc), list[str | int](["body"])
    m = _MSGSPEC_AT.match(text)
    if m:
        text = m.group(1)
        for name, index in _PATH_PART.findall(m.group(2)):
            loc.append(name or int(index))
    return [{"loc": loc, "msg": f"Value error, {text}", "type": "value_error"}]


def _num(x: float) -> str:
    # pydantic prints bounds the Rust way: 2.0 -> "2", 0.5 -> "0.5".
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)


def _or(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _key(k: object) -> str | int:
    return k if isinstance(k, str | int) and not isinstance(k, bool) else repr(k)


def _unwrap(t: mi.Type) -> mi.Type:
    while isinstance(t, mi.Metadata):
        t = t.type
    return t


def _check(t: mi.Type, v: object, loc: Loc, out: _Errors) -> None:
    t = _unwrap(t)
    if isinstance(t, mi.AnyType):
        return
    if isinstance(t, mi.UnionType):
        _check_union(t, v, loc, out)
    elif isinstance(t, mi.NoneType):
        if v is not None:
            out.add(loc, "none_required", "Input should be None")
    elif isinstance(t, mi.BoolType):
        if not isinstance(v, bool):
            out.add(loc, "bool_type", "Input should be a valid boolean")
    elif isinstance(t, mi.IntType):
        if isinstance(v, bool) or not isinstance(v, int | float):
            out.add(loc, "int_type", "Input should be a valid integer")
        elif isinstance(v, float):
            if not math.isfinite(v):
                out.add(loc, "finite_number", "Input should be a finite number")
            elif v.is_integer():  # beyond 64 bits (validate() took the others as integers)
                out.add(loc, "int_type", "Input should be a valid integer")
            else:
                out.add(loc, "int_from_float",
                        "Input should be a valid integer, got a number with a fractional part")
        else:
            _check_bounds(t, v, loc, out)
    elif isinstance(t, mi.FloatType):
        if isinstance(v, bool) or not isinstance(v, int | float):
            out.add(loc, "float_type", "Input should be a valid number")
        elif isinstance(v, int) and abs(v) >= _FLOAT_OVERFLOW:
            out.add(loc, "finite_number", "Input should be a finite number")
        else:
            _check_bounds(t, v, loc, out)
    elif isinstance(t, mi.StrType):
        _check_str(t, v, loc, out)
    elif isinstance(t, mi.LiteralType):
        if not any(type(v) is type(x) and v == x for x in t.values):
            out.add(loc, "literal_error", f"Input should be {_choices(t, out)}")
    elif isinstance(t, mi.CollectionType):
        _check_items(t, v, loc, out)
    elif isinstance(t, mi.DictType):
        _check_dict(t, v, loc, out)
    elif isinstance(t, mi.StructType):
        _check_struct(t, v, loc, out)
    # Any other kind (datetime, enum, tuple, ...): no opinion; _explain falls back to msgspec.


def _check_bounds(t: mi.IntType | mi.FloatType, v: float, loc: Loc, out: _Errors) -> None:
    # Negated comparisons so that NaN fails a bound, as it does in msgspec. pydantic reports only
    # the first failing constraint, in this order.
    if t.multiple_of is not None and v % t.multiple_of != 0:
        out.add(loc, "multiple_of", f"Input should be a multiple of {_num(t.multiple_of)}")
    elif t.le is not None and not v <= t.le:
        out.add(loc, "less_than_equal", f"Input should be less than or equal to {_num(t.le)}")
    elif t.lt is not None and not v < t.lt:
        out.add(loc, "less_than", f"Input should be less than {_num(t.lt)}")
    elif t.ge is not None and not v >= t.ge:
        out.add(loc, "greater_than_equal",
                f"Input should be greater than or equal to {_num(t.ge)}")
    elif t.gt is not None and not v > t.gt:
        out.add(loc, "greater_than", f"Input should be greater than {_num(t.gt)}")


def _check_str(t: mi.StrType, v: object, loc: Loc, out: _Errors) -> None:
    if not isinstance(v, str):
        out.add(loc, "string_type", "Input should be a valid string")
    elif t.min_length is not None and len(v) < t.min_length:
        out.add(loc, "string_too_short",
                f"String should have at least {_plural(t.min_length, 'character')}")
    elif t.max_length is not None and len(v) > t.max_length:
        out.add(loc, "string_too_long",
                f"String should have at most {_plural(t.max_length, 'character')}")
    elif t.pattern is not None and re.search(t.pattern, v) is None:
        out.add(loc, "string_pattern_mismatch", f"String should match pattern '{t.pattern}'")


def _check_length(t: mi.CollectionType | mi.DictType, n: int, what: str, loc: Loc,
                  out: _Errors) -> bool:
    if t.min_length is not None and n < t.min_length:
        out.add(loc, "too_short", f"{what} should have at least {_plural(t.min_length, 'item')} "
                                  f"after validation, not {n}")
    elif t.max_length is not None and n > t.max_length:
        out.add(loc, "too_long", f"{what} should have at most {_plural(t.max_length, 'item')} "
                                 f"after validation, not {n}")
    else:
        return True
    return False


def _check_items(t: mi.CollectionType, v: object, loc: Loc, out: _Errors) -> None:
    if not isinstance(v, list | tuple):
        out.add(loc, "list_type", "Input should be a valid list")
    # Length first: a too-long list is one fault, and its items are not worth walking.
    elif _check_length(t, len(v), "List", loc, out):
        for i, item in enumerate(v):
            _check(t.item_type, item, (*loc, i), out)


def _check_dict(t: mi.DictType, v: object, loc: Loc, out: _Errors) -> None:
    if not isinstance(v, dict):
        out.add(loc, "dict_type", "Input should be a valid dictionary")
    elif _check_length(t, len(v), "Dictionary", loc, out):
        for k, item in v.items():
            _check(t.key_type, k, (*loc, _key(k), "[key]"), out)
            _check(t.value_type, item, (*loc, _key(k)), out)


def _check_struct(t: mi.StructType, v: object, loc: Loc, out: _Errors) -> None:
    if t.array_like:
        return  # encoded as a JSON array: not modelled here, msgspec's message is used
    if not isinstance(v, dict):
        out.add(loc, "model_type",
                f"Input should be a valid dictionary or instance of {t.cls.__name__}")
        return
    known: set[str] = set()
    if t.tag_field is not None:
        known.add(t.tag_field)
        if t.tag_field not in v:
            out.add((*loc, t.tag_field), "missing", "Field required")
        elif v[t.tag_field] != t.tag or type(v[t.tag_field]) is not type(t.tag):
            out.add((*loc, t.tag_field), "literal_error", f"Input should be {t.tag!r}")
    for f in t.fields:
        known.add(f.encode_name)
        if f.encode_name in v:
            _check(f.type, v[f.encode_name], (*loc, f.encode_name), out)
        elif f.required:
            out.add((*loc, f.encode_name), "missing", "Field required")
    for k in v:
        if not isinstance(k, str):
            out.add((*loc, _key(k), "[key]"), "string_type", "Input should be a valid string")
        elif t.forbid_unknown_fields and k not in known:
            out.add((*loc, k), "extra_forbidden", "Extra inputs are not permitted")


def _kind_matches(t: mi.Type, v: object) -> bool:
    """Does `t` take values of v's JSON kind? Picks the union member worth reporting."""
    t = _unwrap(t)
    if isinstance(v, bool):
        return isinstance(t, mi.BoolType)
    if isinstance(v, int | float):
        return isinstance(t, mi.IntType | mi.FloatType) or (
            isinstance(t, mi.LiteralType) and any(type(x) is int for x in t.values))
    if isinstance(v, str):
        return isinstance(t, mi.StrType) or (
            isinstance(t, mi.LiteralType) and any(isinstance(x, str) for x in t.values))
    if isinstance(v, list | tuple):
        return isinstance(t, mi.CollectionType)
    if isinstance(v, dict):
        return isinstance(t, mi.DictType | mi.StructType)
    return False


def _choices(t: mi.LiteralType, out: _Errors) -> str:
    values = out.orders.get(frozenset(t.values), t.values)
    return _or([repr(x) for x in values])


def _expected(t: mi.Type, out: _Errors) -> str:
    t = _unwrap(t)
    if isinstance(t, mi.LiteralType):
        return _choices(t, out)
    return next((words for kind, words in _EXPECTED if isinstance(t, kind)), "a valid value")


_EXPECTED: Final[tuple[tuple[type | types.UnionType, str], ...]] = (
    (mi.BoolType, "a valid boolean"), (mi.IntType, "a valid integer"),
    (mi.FloatType, "a valid number"), (mi.StrType, "a valid string"),
    (mi.CollectionType, "a valid list"), (mi.DictType | mi.StructType, "a valid dictionary"))


def _trial(t: mi.Type, v: object, loc: Loc, out: _Errors) -> list[tuple[Loc, str, str]]:
    sub = _Errors(out.limit, out.orders)
    with contextlib.suppress(_Full):
        _check(t, v, loc, sub)
    return sub.items


def _check_union(t: mi.UnionType, v: object, loc: Loc, out: _Errors) -> None:
    members = [m for m in t.types if not isinstance(_unwrap(m), mi.NoneType)]
    if v is None and len(members) < len(t.types):
        return
    if len(members) == 1:  # Optional[X]: report X's error only, as FastAPI does
        _check(members[0], v, loc, out)
        return
    candidates = [m for m in members if _kind_matches(m, v)]
    if isinstance(v, dict) and len(candidates) > 1:
        # msgspec only allows several object members when they are all tagged Structs.
        structs = [s for s in map(_unwrap, candidates) if isinstance(s, mi.StructType)]
        field = structs[0].tag_field if structs else None
        if field is None or field not in v:
            out.add(loc, "union_tag_not_found",
                    f"Unable to extract tag using discriminator '{field}'")
            return
        tag = v[field]
        candidates = [s for s in structs if s.tag == tag and type(s.tag) is type(tag)]
        if not candidates:
            tags = ", ".join(repr(s.tag) for s in structs)
            out.add(loc, "union_tag_invalid", f"Input tag {repr(tag)[:40]} found using '{field}' "
                                              f"does not match any of the expected tags: {tags}")
            return
    if not candidates:
        words = list(dict.fromkeys(_expected(m, out) for m in members))
        out.add(loc, "union_type", f"Input should be {_or(words)}")
        return
    best: list[tuple[Loc, str, str]] | None = None
    for m in candidates:
        errs = _trial(m, v, loc, out)
        if not errs:
            return
        if best is None or len(errs) < len(best):
            best = errs
    for e_loc, msg, kind in best or ():
        out.add(e_loc, kind, msg)
