"""kvcs: stream LLM KV caches layer by layer over MOQT (draft-ietf-moq-transport-22).

One import root: ``kvcs.transports`` (QUIC and loopback bindings, the ``kvcs``
command), ``kvcs.adapters`` (numpy, cache files) and the pure core ``kvcs_core``.
"""
