"""Tensors at the edge: numpy, torch and inference-library KV-cache adapters (arrive later).

* ``kvcs.adapters.numpy_kv``: numpy engine arrays <-> KVSP K/V sections (zero-copy views or one
  documented copy), ``KvDestination`` for consumers, vectorised q8 and dtype conversions.
* ``kvcs.adapters.torch_kv``: the same for torch tensors on CPU or CUDA (HND, NHD and paged
  layouts, ``TorchKvDestination``, ``TorchLayerPublisher``); it imports torch, so it is never
  imported from here (``pip install 'kvcs[torch]'``).
"""
