"""The OpenAPI 3.1.0 document (spec: Versioning), generated from the request Structs.

The request schemas here are the very types the validator converts bodies into, so the published
bounds and the 422s the gateway sends cannot disagree; the cross-field usage rules, which msgspec
types cannot carry, are stated next to the Python rules as each Struct's `json_schema_rules` and
merged into its component here. Every route in the app's route table carries a `Doc`, and the
document is rendered from that table (`proxy.app.ROUTES`), so a route cannot exist undescribed.

What a route's doc is made of is in doc_types.py, the error answers per family of routes in
error_docs.py, each route's doc in route_docs.py; this module renders them (`build_openapi`) and
serves the result (`document`).

What depends on the running deployment (the tiers a key may be issued for, the models served) is
filled in when the document is served (`document`), so it is true after a policy reload too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from functools import lru_cache
from typing import Any, Final, NamedTuple

import msgspec
import orjson
from aiohttp import web
from msgspec import inspect as mi

from proxy import appkeys
from proxy.api.doc_types import (
    ADMIN,
    API_KEY,
    BEARER,
    EXAMPLE_MODEL,
    JSON,
    REQUEST_ID,
    SSE,
    Doc,
    Family,
    Header,
    Param,
    Response,
)
from proxy.api.error_docs import error, for_family
from proxy.identity.principal import GUEST_TIER

# Doc, Header, Param and Response are the route table's (proxy.app) and the dashboard's.
__all__ = ["ADMIN", "API_KEY", "BEARER", "Doc", "Header", "Param", "Response", "build_openapi",
           "document"]

_REF_TEMPLATE: Final = "#/components/schemas/{name}"
_PATH_PARAM: Final = re.compile(r"\{([^}/]+)\}")

_SECURITY_SCHEMES: Final[dict[str, Any]] = {
    API_KEY: {"type": "apiKey", "in": "header", "name": "X-API-Key",
              "description": "API key `<prefix>_sk_...`; wins over Authorization if both are sent"},
    BEARER: {"type": "http", "scheme": "bearer",
             "description": "`Authorization: Bearer <API key or JWT>`"},
    ADMIN: {"type": "http", "scheme": "bearer",
            "description": "`Authorization: Bearer <GATEWAY_ADMIN_TOKEN>` or an admin-role JWT"},
}

# ---- rendering -------------------------------------------------------------------------------


def _is_json(content_type: str) -> bool:
    return content_type == JSON or content_type.endswith("+json")


def operation_id(method: str, path: str) -> str:
    slash = "_slash" if path.endswith("/") else ""  # /v2/native and /v2/native/ are two routes
    return re.sub(r"[^A-Za-z0-9]+", "_", f"{method} {path}").strip("_").lower() + slash


def build_openapi(routes: Iterable[tuple[str, str, Doc, Family]], *, title: str, version: str
                  ) -> dict[str, Any]:
    """Render `(method, path, doc, error family)` routes as an OpenAPI 3.1.0 document (a
    JSON-ready dict)."""
    table = list(routes)
    answers = [_answers(doc, family) for _, _, doc, family in table]
    ops = [(method, path, doc) for method, path, doc, _ in table]
    # All types go through one schema_components call so shared Structs become one component.
    types: list[object] = []
    for (_, _, doc), responses in zip(ops, answers, strict=True):
        if doc.request is not None:
            types.append(doc.request)
        types.extend(b for r in responses.values() for b in (r.body, r.or_body) if b is not None)
    unique = list(dict.fromkeys(types))
    schemas, components = msgspec.json.schema_components(unique, ref_template=_REF_TEMPLATE)
    schema_of = dict(zip(unique, schemas, strict=True))
    for struct in _structs(unique):
        rules = getattr(struct, "json_schema_rules", None)
        if rules is not None:
            _merge_rules(components[struct.__name__], rules)

    paths: dict[str, dict[str, Any]] = {}
    for (method, path, doc), responses in zip(ops, answers, strict=True):
        item: dict[str, Any] = {"summary": doc.summary,
                                "operationId": operation_id(method, path)}
        if doc.description:
            item["description"] = doc.description
        if doc.tags:
            item["tags"] = list(doc.tags)
        declared = {p.name for where, p in doc.params if where == "path"}
        params = [_param("path", Param(name, {"type": "string"}, required=True))
                  for name in _PATH_PARAM.findall(path) if name not in declared]
        params += [_param(where, p) for where, p in doc.params]
        if params:
            item["parameters"] = params
        if doc.request is not None:
            media: dict[str, Any] = {"schema": schema_of[doc.request]}
            if doc.example is not None:
                media["example"] = doc.example
            item["requestBody"] = {"required": True, "content": {JSON: media}}
        elif doc.form is not None:
            item["requestBody"] = {"required": True,
                                   "content": {"multipart/form-data": {"schema": doc.form}}}
        item["responses"] = {str(status): _response(response, schema_of)
                             for status, response in sorted(responses.items())}
        security: list[dict[str, list[str]]] = [{name: []} for name in doc.security]
        item["security"] = [*security, {}] if doc.auth_optional else security
        paths.setdefault(path, {})[method.lower()] = item

    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": _SECURITY_SCHEMES},
    }


def _structs(types: Iterable[object]) -> Iterator[type[msgspec.Struct]]:
    """Every Struct class the types reach, once."""
    seen: set[type] = set()
    stack: list[mi.Type] = list(mi.multi_type_info(list(types)))
    while stack:
        t = stack.pop()
        if isinstance(t, mi.StructType):
            if t.cls in seen:
                continue
            seen.add(t.cls)
            yield t.cls
            stack.extend(f.type for f in t.fields)
        elif isinstance(t, mi.Metadata | mi.CollectionType):
            stack.append(t.type if isinstance(t, mi.Metadata) else t.item_type)
        elif isinstance(t, mi.UnionType):
            stack.extend(t.types)
        elif isinstance(t, mi.DictType):
            stack.extend((t.key_type, t.value_type))


def _merge_rules(schema: dict[str, Any], rules: Mapping[str, Any]) -> None:
    """Add a Struct's usage rules to its generated component."""
    for key, value in rules.items():
        if key == "properties":
            for name, extra in value.items():
                schema["properties"][name].update(extra)
        elif key == "required":
            schema["required"] = list(dict.fromkeys([*schema.get("required", ()), *value]))
            for name in value:  # a default only lets the validator word its refusal
                schema["properties"][name].pop("default", None)
        elif key == "allOf":
            schema["allOf"] = [*schema.get("allOf", ()), *value]
        else:
            schema[key] = value


_DRAINING: Final = "the gateway is shutting down (draining)"
_BAD_HEADERS: Final = "a header name has an underscore (invalid_request)"


def _answers(doc: Doc, family: Family) -> dict[int, Response]:
    """The route's own answers, plus those the middleware gives every route before the route
    runs (in the route family's error shape): 400 for an underscore in a header name, and
    503 while the gateway drains (not on the health probes)."""
    responses = dict(doc.responses)
    responses[400] = _also(responses.get(400), family, 400, _BAD_HEADERS)
    if doc.drains:
        responses[503] = _also(responses.get(503), family, 503, _DRAINING)
    return responses


def _also(documented: Response | None, family: Family, status: int, when: str) -> Response:
    when = for_family(family, when)
    if documented is None:
        return error(family, status, when[0].upper() + when[1:])
    return replace(documented, description=f"{documented.description}; or {when}")


def _param(where: str, p: Param) -> dict[str, Any]:
    out = {"name": p.name, "in": where, "required": p.required or where == "path",
           "schema": dict(p.schema)}
    if p.description:
        out["description"] = p.description
    return out


def _response(response: Response, schema_of: dict[object, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"description": response.description}
    content: dict[str, Any] = {}
    kinds = response.content
    for ct in (kinds,) if isinstance(kinds, str) else kinds:
        if response.body is not None and _is_json(ct):
            schema = schema_of[response.body]
            if response.or_body is not None:
                schema = {"anyOf": [schema, schema_of[response.or_body]]}
            content[ct] = {"schema": schema}
        elif ct == SSE and response.event is not None:
            content[ct] = {"schema": dict(response.event)}
        elif ct.startswith("text/"):
            content[ct] = {"schema": {"type": "string"}}
        else:  # a stream of JSON lines, or bytes: described by its media type alone
            content[ct] = {}
    if content:
        out["content"] = content
    headers = {"X-Request-Id": REQUEST_ID, **response.headers}
    out["headers"] = {name: {"description": h.description, "required": h.required,
                             "schema": dict(h.schema)} for name, h in headers.items()}
    if response.links:
        out["links"] = {name: dict(link) for name, link in response.links.items()}
    return out


# ---- serving: the deployment's own facts filled in ------------------------------------------


async def document(request: web.Request) -> web.Response:
    app = request.app
    policies = app[appkeys.LIVE].current.policies
    tiers = tuple(sorted(set(policies.tiers.tiers) - {GUEST_TIER}))
    caps = policies.requests
    router = app[appkeys.ROUTER]
    body = _live(app[appkeys.OPENAPI](), tiers, tuple(router.chat_models),
                 tuple(router.models("tts")), tuple(router.models("asr")),
                 tuple(router.models("embed")),
                 Limits(caps.tts.max_characters, caps.generation.max_images,
                        caps.generation.max_video_s, caps.embed.max_inputs),
                 (tuple(router.providers("image")), tuple(router.providers("video"))))
    return web.Response(body=body, content_type=JSON)


class Limits(NamedTuple):
    """requests.toml's bounds that the schemas state at their widest."""

    tts_characters: int
    images: int
    video_s: int
    embed_inputs: int


@lru_cache(maxsize=8)
def _live(base: bytes, tiers: tuple[str, ...], models: tuple[str, ...],
          speech_models: tuple[str, ...], asr_models: tuple[str, ...],
          embed_models: tuple[str, ...], limits: Limits,
          providers: tuple[tuple[str, ...], tuple[str, ...]]) -> bytes:
    """The built document with the tiers keys may be issued for, the models and providers
    served, and this gateway's own request limits."""
    doc = orjson.loads(base)
    schemas = doc["components"]["schemas"]
    schemas["TtsRequest"]["properties"]["text"]["maxLength"] = limits.tts_characters
    schemas["SpeechRequest"]["properties"]["input"]["maxLength"] = limits.tts_characters
    if speech_models:
        schemas["SpeechRequest"]["properties"]["model"]["examples"] = list(speech_models)
    for path in ("/v2/compat/v1/audio/transcriptions", "/v2/compat/v1/audio/translations"):
        form = doc["paths"][path]["post"]["requestBody"]["content"]["multipart/form-data"]
        if asr_models:
            form["schema"]["properties"]["model"]["examples"] = list(asr_models)
    embeddings = schemas["EmbeddingsRequest"]
    for branch in embeddings["allOf"][0]["properties"]["input"]["anyOf"]:
        if "maxItems" in branch:
            branch["maxItems"] = limits.embed_inputs
    if embed_models:
        embeddings["properties"]["model"]["examples"] = list(embed_models)
        example = doc["paths"]["/v2/compat/v1/embeddings"]["post"]["requestBody"]["content"][
            JSON]["example"]
        example["model"] = embed_models[0]
    _set_maximum(schemas["ImageRequest"]["properties"]["n"], limits.images)
    for name in ("seconds", "duration"):
        _set_maximum(schemas["VideoRequest"]["properties"][name], limits.video_s)
    for family, names in zip(("image", "video"), providers, strict=True):
        for path, item in doc["paths"].items():
            if path.startswith(f"/v2/{family}/") and names:
                for param in item["post"]["parameters"]:
                    if param["name"] == "provider":
                        param["schema"]["enum"] = list(names)
    schemas["CreateKeyBody"]["properties"]["tier"]["enum"] = list(tiers)
    for name in ("ChatRequest", "ServedChatRequest", "ResponsesRequest", "MessagesRequest",
                 "OllamaChatRequest"):
        if models:
            schemas[name]["properties"]["model"]["examples"] = list(models)
    for item in doc["paths"].values():
        for operation in item.values():
            media = operation.get("requestBody", {}).get("content", {}).get(JSON, {})
            example = media.get("example")
            if models and isinstance(example, dict) and example.get("model") == EXAMPLE_MODEL:
                example["model"] = models[0]
    return orjson.dumps(doc)


def _set_maximum(schema: dict[str, Any], maximum: int) -> None:
    for branch in schema.get("anyOf", [schema]):
        if "maximum" in branch:
            branch["maximum"] = maximum
