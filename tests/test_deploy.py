"""deploy/: the compose stack, the image, Prometheus' scrape config, the Grafana dashboard and the
tracing path (gateway -> Jaeger, exemplars -> Grafana -> Jaeger) agree with the repository and with
the metrics the gateway really exports. Nothing here needs Docker or a network: files are parsed,
and the live check runs a gateway on loopback."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import shutil
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp
import orjson
import yaml
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from proxy.api.scrape import SCRAPE_TIME_METRICS
from proxy.appkeys import CONFIG
from proxy.config import load_config
from proxy.credits.ledger import Ledger
from proxy.observe.metrics import Labels, Metrics
from proxy.runtime.signal_scraper import SignalScraper
from proxy.store.background import stop_task
from proxy.store.redis_process import RedisProcess
from proxy.upstream.fleet_state import signals_key
from tests.support.accounts import new_key
from tests.support.config_files import MODEL
from tests.support.gateway import GatewayFactory, settled
from tests.support.upstreams import SimulatorFactory

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "inference-gateway.json"
DATASOURCE_DIR = DEPLOY / "grafana" / "provisioning" / "datasources"
DATASOURCES = DATASOURCE_DIR / "prometheus.yml"
DASHBOARD_PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "dashboards.yml"
METRIC_NAME = re.compile(r"\bigw_[A-Za-z0-9_:]*")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# The histograms whose buckets carry exemplars, and the exemplars' label naming the trace.
EXEMPLAR_HISTOGRAMS = ("igw_request_duration_seconds", "igw_time_to_first_token_seconds")
EXEMPLAR_LABEL = "trace_id"
OTLP_HTTP_PORT = 4318


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def compose() -> dict[str, Any]:
    document: dict[str, Any] = load_yaml(DEPLOY / "compose.yaml")
    return document


def services() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose()["services"]
    return found


def container_ports(service: dict[str, Any]) -> list[int]:
    """The container side of each published port ("8080:8080", "127.0.0.1:3000:3000")."""
    return [int(str(spec).rsplit(":", 1)[-1].split("/")[0]) for spec in service.get("ports", [])]


def bind_mounts(service: dict[str, Any]) -> Iterator[tuple[Path, str]]:
    """(host path, container path) of every bind mount; named volumes are left out."""
    for spec in service.get("volumes", []):
        source, target = str(spec).split(":")[:2]
        if source.startswith((".", "/")):
            yield (DEPLOY / source).resolve(), target


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        pending += " " + stripped.removesuffix("\\").strip()
        if not stripped.endswith("\\"):
            keyword, _, arguments = pending.strip().partition(" ")
            instructions.append((keyword.upper(), arguments.strip()))
            pending = ""
    assert not pending, "Dockerfile ends inside a continued line"
    return instructions


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile()
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def exec_form(arguments: str) -> list[str]:
    """CMD/ENTRYPOINT arguments: the JSON (exec) form, else shell words."""
    if arguments.startswith("["):
        words: list[str] = json.loads(arguments)
        return words
    return shlex.split(arguments)


def option(words: list[str], name: str) -> str:
    assert name in words, f"{name} missing from {words}"
    return words[words.index(name) + 1]


def image_config_dir() -> str:
    """The config folder the image's CMD serves (`--config`)."""
    (cmd,) = [exec_form(args) for keyword, args in final_stage() if keyword == "CMD"]
    return option(cmd, "--config").rstrip("/")


def gateway_config() -> Path:
    """The backends.toml the compose gateway reads: a bind mount over the image's, else the
    image's own (the repository's root backends.toml)."""
    target = f"{image_config_dir()}/backends.toml"
    mounted = [host for host, path in bind_mounts(services()["gateway"]) if path == target]
    assert len(mounted) <= 1, mounted
    return mounted[0] if mounted else ROOT / "backends.toml"


def reachable_ports(service: dict[str, Any]) -> set[int]:
    """Container ports other services may use: `expose` and the container side of `ports`."""
    exposed = {int(str(spec).split("/")[0]) for spec in service.get("expose", [])}
    return exposed | set(container_ports(service))


def environment(service: dict[str, Any]) -> dict[str, str]:
    """A service's environment, from either compose form (a mapping or KEY=VALUE strings)."""
    found = service.get("environment", {})
    if isinstance(found, list):
        return dict(str(item).partition("=")[::2] for item in found)
    return {key: str(value) for key, value in found.items()}


def dashboard() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return document


def panels(items: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, including those inside (collapsed) rows."""
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def expressions() -> list[str]:
    return [target["expr"] for panel in panels(dashboard()["panels"])
            for target in panel.get("targets", []) if "expr" in target]


def dashboard_metrics() -> set[str]:
    return {name for expr in expressions() for name in METRIC_NAME.findall(expr)}


def provisioned_datasource() -> dict[str, Any]:
    (source,) = load_yaml(DATASOURCES)["datasources"]
    found: dict[str, Any] = source
    return found


def all_datasources() -> list[dict[str, Any]]:
    """Every data source Grafana provisions (it reads every YAML file in the folder)."""
    return [source for path in sorted(DATASOURCE_DIR.iterdir())
            if path.suffix in (".yml", ".yaml")
            for source in load_yaml(path).get("datasources", [])]


def exposed_names(families: Iterable[Any]) -> set[str]:
    """The series names a scrape shows for these metric families (prometheus-client drops
    `_total` from a counter family's name; the series keep it)."""
    names: set[str] = set()
    for family in families:
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names.update(family.name + suffix for suffix in HISTOGRAM_SUFFIXES)
        else:
            names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def registry_names() -> set[str]:
    """What the workers count, straight from the gateway's own metric definitions."""
    registry = CollectorRegistry()
    Metrics(Labels(models=[MODEL], tiers=lambda: {"max"}, backends=["b0"]), registry)
    return exposed_names(registry.collect())


# -- compose --------------------------------------------------------------------------------------

def test_compose_has_the_five_services() -> None:
    assert set(services()) >= {"gateway", "redis", "prometheus", "grafana", "jaeger"}
    assert services()["redis"]["image"].startswith("redis:7")
    assert set(compose()["volumes"]) >= {"redis-data", "prometheus-data", "grafana-data"}


def test_compose_builds_the_gateway_from_the_repository() -> None:
    build = services()["gateway"]["build"]
    context = (DEPLOY / build["context"]).resolve()
    assert context == ROOT
    assert (context / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"


def test_every_mounted_host_path_exists() -> None:
    mounts = [(name, host) for name, service in services().items()
              for host, _ in bind_mounts(service)]
    assert len(mounts) >= 5  # backends.toml, policies, prometheus.yml, provisioning, dashboards
    for name, host in mounts:
        assert host.exists(), f"{name} mounts {host}, which is not in the repository"
        assert ROOT in host.parents, f"{name} mounts {host}, outside the repository"


def test_gateway_points_at_the_redis_service_which_keeps_the_ledger_durable() -> None:
    url = urlparse(services()["gateway"]["environment"]["GATEWAY_REDIS_URL"])
    assert url.scheme == "redis" and url.hostname == "redis" and (url.port or 6379) == 6379
    assert "redis" in services()["gateway"]["depends_on"]
    command = services()["redis"]["command"]
    words = command if isinstance(command, list) else shlex.split(command)
    assert option(words, "--appendonly") == "yes"
    assert option(words, "--appendfsync") == "always"
    assert "redis-data:/data" in services()["redis"]["volumes"]  # the AOF outlives the container


def test_ports_match_the_image_and_the_ledger_is_not_published() -> None:
    expose = {int(word) for keyword, args in final_stage() if keyword == "EXPOSE"
              for word in args.split()}
    assert container_ports(services()["gateway"]) == sorted(expose) == [8080]
    assert container_ports(services()["grafana"]) == [3000]
    assert container_ports(services()["prometheus"]) == [9090]
    assert container_ports(services()["redis"]) == []
    assert container_ports(services()["jaeger"]) == [16686]  # the UI; OTLP stays on the network


# -- traces: the gateway exports to the jaeger service -------------------------------------------

def test_jaeger_is_pinned_and_receives_otlp_over_http() -> None:
    jaeger = services()["jaeger"]
    image, _, tag = jaeger["image"].partition(":")
    assert image == "jaegertracing/all-in-one"
    assert re.fullmatch(r"\d+\.\d+\.\d+", tag), f"pin a version, not {tag or 'latest'!r}"
    assert environment(jaeger).get("COLLECTOR_OTLP_ENABLED") == "true"
    assert OTLP_HTTP_PORT in reachable_ports(jaeger)
    assert "jaeger" in services()["gateway"]["depends_on"]


def test_compose_gateway_config_sends_traces_to_jaeger() -> None:
    config = gateway_config()
    assert config != ROOT / "backends.toml", \
        "compose must mount its own backends.toml: the shipped one has no jaeger to send to"
    assert config.exists() and ROOT in config.parents
    telemetry = tomllib.loads(config.read_text()).get("telemetry")
    assert telemetry, f"{config.relative_to(ROOT)} has no [telemetry]: tracing is off"
    url = urlparse(telemetry["endpoint"])
    assert url.scheme == "http" and url.path == "/v1/traces", telemetry["endpoint"]
    assert url.hostname == "jaeger" and url.hostname in services()
    assert url.port == OTLP_HTTP_PORT and url.port in reachable_ports(services()[url.hostname])
    assert 0 <= telemetry["sample_ratio"] <= 1
    assert telemetry.get("capture_content", False) is False  # no prompts in a demo's spans


def test_compose_gateway_config_is_the_shipped_one_plus_telemetry() -> None:
    shipped = tomllib.loads((ROOT / "backends.toml").read_text())
    assert "telemetry" not in shipped  # no jaeger outside compose: tracing stays off there
    ours = tomllib.loads(gateway_config().read_text())
    ours.pop("telemetry", None)
    assert ours == shipped, (
        f"{gateway_config().relative_to(ROOT)} must stay the root backends.toml plus [telemetry]: "
        "carry the root file's change over")


def test_compose_gateway_config_loads(tmp_path: Path) -> None:
    """What the container serves (the mounted backends.toml, the repository's policies/)
    passes the gateway's own checks, [telemetry] included."""
    folder = tmp_path / "gateway"
    folder.mkdir()
    mounts = {path: host for host, path in bind_mounts(services()["gateway"])}
    config_dir = image_config_dir()
    shutil.copy(mounts[f"{config_dir}/backends.toml"], folder / "backends.toml")
    shutil.copytree(mounts[f"{config_dir}/policies"], folder / "policies")
    config = load_config(folder)
    assert config.telemetry is not None
    assert config.telemetry.endpoint == tomllib.loads(
        gateway_config().read_text())["telemetry"]["endpoint"]


# -- the image ------------------------------------------------------------------------------------

def test_dockerfile_base_user_healthcheck_and_command() -> None:
    stage = final_stage()
    keywords = [keyword for keyword, _ in stage]
    assert all(args.split()[0].startswith("python:3.11-slim")
               for keyword, args in dockerfile() if keyword == "FROM")
    users = [args for keyword, args in stage if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert keywords.index("USER") < keywords.index("CMD")
    (healthcheck,) = [args for keyword, args in stage if keyword == "HEALTHCHECK"]
    assert "/healthz" in healthcheck and ":8080/" in healthcheck
    (cmd,) = [exec_form(args) for keyword, args in stage if keyword == "CMD"]
    assert cmd[:2] == ["inference-gateway", "serve"]
    assert option(cmd, "--host") == "0.0.0.0" and option(cmd, "--port") == "8080"
    # The config folder CMD names is where the shipped config is copied.
    config = option(cmd, "--config").rstrip("/")
    copied = {exec_form(args)[-1].rstrip("/") for keyword, args in stage if keyword == "COPY"
              and not args.startswith("--from")}
    assert {f"{config}/backends.toml", f"{config}/policies"} <= copied


def test_every_copied_source_exists_in_the_repository() -> None:
    copies = [args.split() for keyword, args in dockerfile() if keyword in ("COPY", "ADD")]
    checked = 0
    for words in copies:
        if any(word.startswith("--from") for word in words):
            continue  # from another build stage
        sources = [word for word in words if not word.startswith("--")][:-1]
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
            checked += 1
    assert checked >= 4  # the package, its metadata, the shipped config


# -- Prometheus and Grafana -----------------------------------------------------------------------

def test_prometheus_scrapes_the_gateway_service() -> None:
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    port = container_ports(services()["gateway"])[0]
    (job,) = [job for job in config["scrape_configs"]
              if any(f"gateway:{port}" in group["targets"] for group in job["static_configs"])]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job.get("scrape_interval", config["global"]["scrape_interval"]) == "15s"
    (mount,) = [target for host, target in bind_mounts(services()["prometheus"])
                if host == DEPLOY / "prometheus" / "prometheus.yml"]
    assert f"--config.file={mount}" in services()["prometheus"]["command"]


def test_prometheus_keeps_the_gateways_exemplars() -> None:
    command = services()["prometheus"]["command"]
    features = {feature for word in command if word.startswith("--enable-feature=")
                for feature in word.removeprefix("--enable-feature=").split(",")}
    assert "exemplar-storage" in features
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    port = container_ports(services()["gateway"])[0]
    (job,) = [job for job in config["scrape_configs"]
              if any(f"gateway:{port}" in group["targets"] for group in job["static_configs"])]
    # Only OpenMetrics carries exemplars: it must be what Prometheus asks for first.
    protocols = job.get("scrape_protocols") or config["global"].get("scrape_protocols")
    assert protocols and protocols[0].startswith("OpenMetricsText"), protocols


def test_grafana_links_exemplars_to_the_jaeger_datasource() -> None:
    sources = all_datasources()
    uids = [source["uid"] for source in sources]
    assert len(uids) == len(set(uids))
    assert [source["type"] for source in sources if source.get("isDefault")] == ["prometheus"]
    (jaeger,) = [source for source in sources if source["type"] == "jaeger"]
    url = urlparse(jaeger["url"])
    assert url.hostname == "jaeger" and url.port in container_ports(services()["jaeger"])
    destinations = provisioned_datasource()["jsonData"]["exemplarTraceIdDestinations"]
    assert {(d["name"], d.get("datasourceUid")) for d in destinations} == {
        (EXEMPLAR_LABEL, jaeger["uid"])}


def test_grafana_provisioning_matches_the_stack() -> None:
    source = provisioned_datasource()
    assert source["type"] == "prometheus" and source["uid"]
    url = urlparse(source["url"])
    assert url.hostname == "prometheus" and url.port == container_ports(
        services()["prometheus"])[0]
    mounts = dict(bind_mounts(services()["grafana"]))
    assert mounts[DEPLOY / "grafana" / "provisioning"] == "/etc/grafana/provisioning"
    (provider,) = load_yaml(DASHBOARD_PROVIDERS)["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == mounts[DEPLOY / "grafana" / "dashboards"]


def test_every_panel_queries_the_provisioned_datasource() -> None:
    board = dashboard()
    uid = provisioned_datasource()["uid"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    # A datasource variable lets an imported copy pick any Prometheus; here it defaults to ours.
    chosen = {uid}
    if "datasource" in variables:
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        assert variables["datasource"]["current"]["value"] == uid
        chosen.add("${datasource}")
    queried = [p for p in panels(board["panels"]) if p["type"] != "row"]
    assert len(queried) >= 15
    for panel in queried:
        for holder in [panel, *panel["targets"]]:
            assert holder["datasource"]["type"] == "prometheus", panel["title"]
            assert holder["datasource"]["uid"] in chosen, panel["title"]
    assert 36 <= board["schemaVersion"] <= 41
    ids = [p["id"] for p in panels(board["panels"])]
    assert len(ids) == len(set(ids))


def test_rates_use_grafanas_rate_interval() -> None:
    ranges = [m for expr in expressions()
              for m in re.findall(r"\b(?:rate|increase|irate)\(\s*[^\[]*\[([^\]]+)\]", expr)]
    assert ranges and set(ranges) <= {"$__rate_interval", "$__range"}
    assert "$__rate_interval" in ranges


def test_latency_panels_are_quantiles_of_the_histograms() -> None:
    quantiles = [expr for expr in expressions() if "histogram_quantile" in expr]
    for metric in ("igw_request_duration_seconds", "igw_time_to_first_token_seconds",
                   "igw_upstream_response_seconds"):
        used = [expr for expr in quantiles if f"{metric}_bucket" in expr]
        assert used, f"no quantile of {metric}"
        assert all(re.search(r"by \([^)]*\ble\b", expr) for expr in used)
    assert any(expr.startswith("histogram_quantile(0.99") for expr in quantiles)


def test_latency_panels_show_exemplars() -> None:
    """Each time series of the two histograms asks for exemplars, on one query per panel: every
    quantile of a histogram reads the same buckets, so more would draw each exemplar again."""
    found: set[str] = set()
    for panel in panels(dashboard()["panels"]):
        for metric in EXEMPLAR_HISTOGRAMS:
            targets = [t for t in panel.get("targets", [])
                       if f"{metric}_bucket" in t.get("expr", "")]
            if not targets or panel["type"] != "timeseries":
                continue  # a stat panel draws no exemplars
            asking = [t["refId"] for t in targets if t.get("exemplar") is True]
            assert len(asking) == 1, f"{panel['title']}: exemplars on {asking or 'no query'}"
            found.add(metric)
    assert found == set(EXEMPLAR_HISTOGRAMS)


# -- the dashboard asks only for what the gateway exports ----------------------------------------

def test_dashboard_metrics_are_defined_by_the_gateway() -> None:
    used = dashboard_metrics()
    assert len({strip_suffix(name) for name in used}) >= 15, sorted(used)
    # Scrape-time families are listed by base name; a counter's series carry `_total`. Which
    # suffix each really has is pinned by the live scrape below.
    scrape_time = set(SCRAPE_TIME_METRICS) | {f"{name}_total" for name in SCRAPE_TIME_METRICS}
    unknown = used - registry_names() - scrape_time
    assert not unknown, f"the dashboard queries metrics the gateway does not define: {unknown}"


def test_docs_list_every_metric() -> None:
    # The "## Metrics" section of docs/monitoring.md (it was the README's until the docs moved).
    page = (ROOT / "docs" / "monitoring.md").read_text()
    section = page[page.index("## Metrics"):]
    section = section[:section.find("\n## ", 1)]
    base_names = {strip_suffix(name) for name in registry_names()} | set(SCRAPE_TIME_METRICS)
    missing = {name for name in base_names if name not in section}
    assert not missing, f"docs/monitoring.md's metrics table lacks {sorted(missing)}"


def strip_suffix(name: str) -> str:
    for suffix in ("_total", *HISTOGRAM_SUFFIXES, "_created"):
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


TIERS = """
[tiers.guest]
requests_per_minute = 1
families = ["chat"]
models = { "*" = ["direct"] }

[tiers.pro]
requests_per_minute = 100000
families = ["chat"]
models = { "*" = ["direct"] }
priority = 1
max_queue_wait_s = 0

[tiers.max]
requests_per_minute = 100000
families = ["chat", "tts", "asr", "image", "video"]
models = { "*" = ["direct", "network"] }
priority = 2
"""
PRICES = """
version = "deploy-test"
[default]
prompt_per_1k_tokens = 1000
completion_per_1k_tokens = 3000
"""
CHAT = "/v2/compat/v1/chat/completions"


async def test_dashboard_metrics_appear_in_a_live_scrape(
    simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    sim = await simulator("vllm")
    # A one-slot engine, so the gateway's queue is used: one request waits, one is shed.
    slow = await simulator("vllm", models=("acme/slow",), ttft_ms=300)
    gw = await gateway(sim, {"name": "slow", "kind": "vllm", "models": ["acme/slow"],
                             "url": str(slow.make_url("/")).rstrip("/"), "max_concurrency": 1},
                       policies={"tiers.toml": TIERS, "prices.toml": PRICES})
    redis = Redis.from_url(clean_redis.url)
    try:  # the fixture's key belongs to acct-test; give it credits so charges are counted
        await Ledger(redis).credit("acct-test", 10**9, {"reason": "test"})
    finally:
        await redis.aclose()
    # The engines' figures come from the master's scraper: run it here, as `serve` would.
    config = gw.app[CONFIG]
    scraper_redis = Redis.from_url(clean_redis.url)
    scraper = asyncio.create_task(SignalScraper(
        config.backends, scraper_redis, signals_key(config.root),
        config.health.engine_signals_s).run())
    key = {"X-API-Key": gw.api_key}  # type: ignore[attr-defined]
    hello = [{"role": "user", "content": "Hello!"}]
    calls: list[tuple[dict[str, str], dict[str, Any], int]] = [
        (key, {"model": MODEL, "messages": hello}, 200),
        (key, {"model": MODEL, "messages": hello, "stream": True}, 200),
        ({"X-API-Key": "igw_sk_not-a-real-key"}, {"model": MODEL, "messages": hello}, 401),
        (key, {"model": "acme/no-such-model", "messages": hello}, 404),
        ({}, {"model": MODEL, "messages": hello, "max_tokens": 8}, 200),  # a guest ...
        ({}, {"model": MODEL, "messages": hello, "max_tokens": 8}, 429),  # ... over its limit
        ({**key, "x-sim-status": "500"}, {"model": MODEL, "messages": hello}, 502),
    ]
    pro = {"X-API-Key": await new_key(clean_redis.url, "pro", account="acct-test")}
    async with aiohttp.ClientSession() as session:
        async def slow_call(headers: dict[str, str]) -> int:
            async with session.post(gw.make_url(CHAT), headers=headers, json={
                    "model": "acme/slow", "messages": [{"role": "user", "content": "Hi"}]}) as r:
                return r.status

        queued = [asyncio.create_task(slow_call(key)) for _ in range(2)]
        await asyncio.sleep(0.1)
        assert await slow_call(pro) == 503  # the one slot is taken and pro may not wait
        assert await asyncio.gather(*queued) == [200, 200]
        for headers, body, expected in calls:
            async with session.post(gw.make_url(CHAT), data=orjson.dumps(body), headers={
                    "Content-Type": "application/json", **headers}) as response:
                await response.read()
                assert response.status == expected, (body, await response.text())
        await settled(gw)
        for _ in range(50):  # a read by the scraper, then the worker's poll of it
            text = await scrape(session, gw)
            if "igw_engine_waiting{" in text:
                break
            await asyncio.sleep(0.1)
    await stop_task(scraper)
    await scraper_redis.aclose()
    families = list(text_string_to_metric_families(text))
    exposed = exposed_names(families)
    missing = dashboard_metrics() - exposed
    assert not missing, f"the dashboard queries metrics /metrics does not show: {sorted(missing)}"
    requests = next(f for f in families if f.name == "igw_requests")
    assert {s.labels["status"] for s in requests.samples if s.name.endswith("_total")} >= {
        "200", "401", "404", "429", "502"}


async def scrape(session: aiohttp.ClientSession, gw: TestServer) -> str:
    async with session.get(gw.make_url("/metrics")) as response:
        text = await response.text()
        assert response.status == 200, f"GET /metrics: {response.status} {text[:200]}"
        assert response.content_type == "text/plain"
        return text
