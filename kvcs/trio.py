"""The public API's two entry points on trio: :func:`connect` and :func:`serve_relay`.

``import kvcs`` is the asyncio API; on trio, take these two from here and everything
else (the objects they return, the options, the errors) from :mod:`kvcs`, which is
the same on both loops::

    import kvcs
    import kvcs.trio

    async with kvcs.trio.connect(url, tls=kvcs.TlsConfig(cafile=ca)) as client:
        ...

The name follows the loop, as ``hypercorn.trio`` does; inside this package it shadows
nothing (``import trio`` anywhere still imports trio itself). The stacks are qh3 (the
default) and aioquic; pquic runs on asyncio only.
"""

from kvcs.transports.quic.trio_binding import connect, serve_relay

__all__ = ["connect", "serve_relay"]
