"""kvcs over real QUIC: aioquic or qh3, driven from asyncio or trio.

* :mod:`.asyncio_binding` and :mod:`.trio_binding`: ``serve_relay`` and ``connect``.
* :mod:`.api`: the objects both return (:class:`~.api.MoqtClient`,
  :class:`~.api.CachePublication`, :class:`~.api.CacheRetrieval`, :class:`~.api.RelayServer`).
* :mod:`.endpoint`, :mod:`.pump`, :mod:`.apps`: the sans-I/O glue between a
  stack's ``QuicConnection`` and the core (no I/O; any event loop can drive it).
* :mod:`.stack`: choosing the QUIC implementation; :mod:`.tls`: certificates.
"""
