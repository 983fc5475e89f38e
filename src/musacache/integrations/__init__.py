"""Serving-engine integrations.

- :mod:`musacache.integrations.vllm`: ``MusaCacheConnector``, a vLLM v1 KV connector
  (``--kv-transfer-config '{"kv_connector": "MusaCacheConnector",
  "kv_connector_module_path": "musacache.integrations.vllm", ...}'``); see docs/vllm.md.
- :mod:`musacache.integrations.sglang`: ``MusaCacheStorage``, an SGLang HiCache storage
  backend (``--hicache-storage-backend dynamic``); see docs/sglang.md.

Each module imports its engine, so importing one needs that engine installed; this package
itself imports nothing.
"""
