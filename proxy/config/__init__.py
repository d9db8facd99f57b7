"""backends.toml and policies/*.toml, parsed once into frozen, typed objects.

Strict: an unknown key, an unknown policy file or a value of the wrong type is an error naming the
file and the key (``backends.toml: backends[0].modles: Extra inputs are not permitted``), and every
error in a file is reported, not just the first. The same msgspec Structs describe the files and
check them, through the collector the request validator uses.

    vocabulary.py   backend kinds, families, modes, bounded value types, the `Section` base
    backends.py     backends.toml: [gateway], [server], [upstream], [health], [supervisor],
                    [routing], [media], [alerts], [telemetry] and the [[backends]]
    policies.py     policies/requests.toml, auth.toml, tiers.toml, prices.toml
    checks.py       the rules that span fields and files
    jwt_keys.py     auth.toml's JWT key material (PyJWT: imported only when JWTs are configured)
    loader.py       `load_config`: files -> `Config`, or a `ConfigError` naming every problem

Import from here: `from proxy.config import Config, load_config`. This package imports nothing
of the gateway's but proxy.headers and proxy.validate.
"""

from proxy.config.backends import (
    AlertsSection,
    BackendsFile,
    BackendSpec,
    GatewaySection,
    HealthSection,
    MediaSection,
    Pick,
    RoutingSection,
    ServerSection,
    SupervisorSection,
    TelemetrySection,
    UpstreamSection,
    Weight,
)
from proxy.config.loader import (
    SHADOW_FILES,
    Config,
    ConfigError,
    ShadowPolicies,
    load_config,
    load_policies,
)
from proxy.config.policies import (
    ANY_GROUP,
    POLICY_FILES,
    STANDARD_GROUP,
    AsrRequestPolicy,
    AuthPolicy,
    Bytes,
    ChatRequestPolicy,
    ClientsPolicy,
    EmbedRequestPolicy,
    FetchPolicy,
    GenerationRequestPolicy,
    JwtPolicy,
    KeysPolicy,
    MicroCredits,
    ModelPrice,
    NetworkPolicy,
    PerMinute,
    Policies,
    PricesPolicy,
    Rates,
    Replicas,
    RequestsPolicy,
    TasksPolicy,
    TierPolicy,
    TiersPolicy,
    TokenLimits,
    TokensPerDay,
    TokensPerMinute,
    TtsRequestPolicy,
)
from proxy.config.vocabulary import (
    CHAT_KINDS,
    EMBED_KINDS,
    FAMILY_OF_KIND,
    VOICE_PRESETS,
    BackendKind,
    Family,
    Mode,
    NonEmpty,
    Port,
    Seconds,
    Section,
)

__all__ = [
    "ANY_GROUP",
    "CHAT_KINDS",
    "EMBED_KINDS",
    "FAMILY_OF_KIND",
    "POLICY_FILES",
    "SHADOW_FILES",
    "STANDARD_GROUP",
    "VOICE_PRESETS",
    "AlertsSection",
    "AsrRequestPolicy",
    "AuthPolicy",
    "BackendKind",
    "BackendSpec",
    "BackendsFile",
    "Bytes",
    "ChatRequestPolicy",
    "ClientsPolicy",
    "Config",
    "ConfigError",
    "EmbedRequestPolicy",
    "Family",
    "FetchPolicy",
    "GatewaySection",
    "GenerationRequestPolicy",
    "HealthSection",
    "JwtPolicy",
    "KeysPolicy",
    "MediaSection",
    "MicroCredits",
    "Mode",
    "ModelPrice",
    "NetworkPolicy",
    "NonEmpty",
    "PerMinute",
    "Pick",
    "Policies",
    "Port",
    "PricesPolicy",
    "Rates",
    "Replicas",
    "RequestsPolicy",
    "RoutingSection",
    "Seconds",
    "Section",
    "ServerSection",
    "ShadowPolicies",
    "SupervisorSection",
    "TasksPolicy",
    "TelemetrySection",
    "TierPolicy",
    "TiersPolicy",
    "TokenLimits",
    "TokensPerDay",
    "TokensPerMinute",
    "TtsRequestPolicy",
    "UpstreamSection",
    "Weight",
    "load_config",
    "load_policies",
]
