"""K and V sections of one block and one layer, and the KVSP layer digest.

Theory of operation
-------------------
Implements ``KVSP-BINDING.md`` section 5 (v0). For block ``b`` and layer ``l``
the K section is the key tensor of shape ``[kv_heads, block_tokens,
head_dim]`` in C order, each element of the descriptor ``dtype`` stored
little-endian (bfloat16 and float8 as raw bit patterns); the V section is the
same for values. Both are ``kv_heads * block_tokens * head_dim * itemsize``
octets (:attr:`CompatibilityDescriptor.section_size`).

The KVSP layer digest is ``SHA-256(K section || V section)``, computed here
without concatenating. With codec ``raw`` it equals ``SHA-256(Data(k) ||
Data(v))`` and the Data Digest of the ``kv`` Object at that Location (profile
section 3.5); with a lossy codec such as ``q8`` the layer digest is still over
the uncompressed sections, which the consumer does not have.

Sections are taken as any bytes-like object and never copied (``memoryview``).
"""

from __future__ import annotations

import hashlib

from kvcs_core.kvsp.descriptor import CompatibilityDescriptor
from kvcs_core.kvsp.dtypes import Buffer
from kvcs_core.kvsp.errors import SectionError


def check_section(
    descriptor: CompatibilityDescriptor, section: Buffer, what: str = "section"
) -> memoryview:
    """``section`` as a byte ``memoryview`` (no copy) after checking its size.

    Raises:
        SectionError: ``section`` is not ``descriptor.section_size`` octets.
    """
    view = memoryview(section).cast("B")
    if len(view) != descriptor.section_size:
        raise SectionError(
            f"{what} is {len(view)} octets, not {descriptor.section_size} "
            f"(kv_heads * block_tokens * head_dim * itemsize)"
        )
    return view


def layer_digest(
    descriptor: CompatibilityDescriptor, k_section: Buffer, v_section: Buffer
) -> bytes:
    """``SHA-256(K section || V section)``: the KVSP layer digest (section 5).

    Raises:
        SectionError: a section has the wrong size.
    """
    digest = hashlib.sha256(check_section(descriptor, k_section, "K section"))
    digest.update(check_section(descriptor, v_section, "V section"))
    return digest.digest()
