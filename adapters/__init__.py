"""Tensors at the edge: numpy, torch and inference-library KV-cache adapters (arrive later).

* ``kvcs.adapters.numpy_kv``: numpy engine arrays <-> KVSP K/V sections (zero-copy views or one
  documented copy), ``KvDestination`` for consumers, vectorised q8 and dtype conversions.
"""
