"""I/O bindings for ``kvcs_core``: loopback, aioquic (asyncio, trio), the ``kvcs`` command."""
