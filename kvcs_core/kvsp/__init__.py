"""The KVSP binding used by kvcs (``KVSP-BINDING.md``, version 0).

Theory of operation
-------------------
The KVCS profile takes four things from KVSP: the Compatibility ID, the Scope
ID, the Block Keys and the codec registry. No public KVSP text exists, so
``../shared/spec/KVSP-BINDING.md`` defines them normatively for kvcs, and all
of it lives behind this package so that it can be swapped for the published
rules later. It is a leaf: pure functions and frozen values over ``bytes``,
no I/O, no entropy (scope keys and Publication IDs are passed in), nothing
from the rest of ``kvcs_core``. Modules, by binding section:

* ``errors``      :class:`KvspError` (a ``ValueError``) and its subclasses
* ``descriptor``  section 1: Compatibility Descriptor rules, ``cd_bytes``
                  (deterministic CBOR), Compatibility ID
* ``keys``        sections 2 and 3: Scope ID, Block Keys, Anchor Key,
                  ``block_keys_sha256``
* ``namespace``   section 4: the five KVCS namespace fields
* ``dtypes``      sections 1 and 5: element types, exact float32 conversions
* ``sections``    section 5: K/V section size and the layer digest
* ``codecs``      section 6: the registry, ``raw`` and ``q8``

Every value in ``kvsp-vectors.json`` is reproduced byte for byte by
``tests/test_kvsp.py``.
"""

from kvcs_core.kvsp.codecs import (
    CODECS,
    Codec,
    CodecInfo,
    codec_from_name,
    codec_from_value,
    decode_kv,
    decode_section,
    encode_kv,
    encode_section,
    encoded_size,
    is_codec_name,
    q8_decode,
    q8_encode,
    q8_size,
)
from kvcs_core.kvsp.descriptor import (
    COMPAT_ID_LEN,
    KVSP_VERSION,
    CompatibilityDescriptor,
    compatibility_id,
)
from kvcs_core.kvsp.dtypes import ITEMSIZE, Dtype, from_float32, to_float32
from kvcs_core.kvsp.errors import DescriptorError, KvspError, SectionError, UnknownCodecError
from kvcs_core.kvsp.keys import (
    BLOCK_KEY_LEN,
    SCOPE_ID_LEN,
    SCOPE_KEY_LEN,
    anchor_key,
    block_keys,
    block_keys_sha256,
    chain_block_keys,
    full_blocks,
    pack_tokens,
    scope_id,
)
from kvcs_core.kvsp.namespace import (
    NAMESPACE_TAG,
    PUBLICATION_ID_LEN,
    KvcsNamespace,
    namespace_fields,
    namespace_prefix,
    parse_namespace,
)
from kvcs_core.kvsp.sections import check_section, layer_digest

__all__ = [
    "BLOCK_KEY_LEN",
    "CODECS",
    "COMPAT_ID_LEN",
    "ITEMSIZE",
    "KVSP_VERSION",
    "NAMESPACE_TAG",
    "PUBLICATION_ID_LEN",
    "SCOPE_ID_LEN",
    "SCOPE_KEY_LEN",
    "Codec",
    "CodecInfo",
    "CompatibilityDescriptor",
    "DescriptorError",
    "Dtype",
    "KvcsNamespace",
    "KvspError",
    "SectionError",
    "UnknownCodecError",
    "anchor_key",
    "block_keys",
    "block_keys_sha256",
    "chain_block_keys",
    "check_section",
    "codec_from_name",
    "codec_from_value",
    "compatibility_id",
    "decode_kv",
    "decode_section",
    "encode_kv",
    "encode_section",
    "encoded_size",
    "from_float32",
    "full_blocks",
    "is_codec_name",
    "layer_digest",
    "namespace_fields",
    "namespace_prefix",
    "pack_tokens",
    "parse_namespace",
    "q8_decode",
    "q8_encode",
    "q8_size",
    "scope_id",
    "to_float32",
]
