"""What the tests share, by topic: fixtures and helpers. No test module imports another
(tests/test_suite_layout.py keeps it so).

Fixtures (pytest plugins, listed in `pytest_plugins` of tests/conftest.py):
  redis_servers     redis_server (one real redis-server per session), clean_redis (it, emptied)
  upstreams         simulator (the project's simulators on loopback); sim_requests, PROBE_AGENT
  gateway           gateway (the app on loopback, on serve's runner, ledger checked at the end);
                    settled
  media_stack       media (gateway + the four media simulators + an audio host); tone(),
                    assert_speech_wav()

Helpers (imported by name):
  config_files      MODEL, tier tables (GENEROUS_TIERS, tiers()), toml_value, write_config
  processes         free_port, wait_until_ready
  accounts          new_key, funded_key, journal, assert_ledger_reconciles
  chat              the chat route: CHAT, HELLO, client_for (openai), post, sse_payloads
  chat_requests     the chat request table's cases and the hypothesis strategies drawn from them
  fleet             Stack (a `serve` process tree), supervised simulator(), admin views
  embedded_redis    serve's own redis-servers: the operator CLI, their processes, /readyz polls
  redis_topologies  Redis Cluster and Sentinel made of real redis-servers
  raw_http          raw-socket HTTP
  media_builders    hand-built audio files (the probes' edge cases)
  encoded_media     real encoder output (PyAV), and its readings
  real_engines      real vLLM replicas of the real-engine tier, and their backends.toml entries
  vllm_metrics      a real vLLM's /metrics, read
  vllm_events       vLLM 0.32's KV-cache event structs, verbatim (what its publisher encodes)
  asr_audio         test audio for the real Whisper replica
  fidelity          JSON shapes and SSE events, compared between a simulator and vLLM
"""
