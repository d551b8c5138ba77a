"""Tensors at the edge: numpy, torch and inference-library KV-cache adapters (arrive later).

* ``kvcs.adapters.numpy_kv``: numpy engine arrays <-> KVSP K/V sections (zero-copy views or one
  documented copy), ``KvDestination`` for consumers, vectorised q8 and dtype conversions.
* ``kvcs.adapters.torch_kv``: the same for torch tensors on CPU or CUDA (HND, NHD and paged
  layouts, ``TorchKvDestination``, ``TorchLayerPublisher``); it imports torch, so it is never
  imported from here (``pip install 'kvcs[torch]'``).
* ``kvcs.adapters.transformers_kv``: Hugging Face transformers 5.x models: the descriptor of a
  model's cache, publishing each layer as the prefill computes it, a ``DynamicCache`` that
  waits per layer while the cache arrives (``pip install 'kvcs[transformers]'``; it imports
  torch and transformers, so it is never imported from here either).
"""
