"""The KVCS profile: namespaces, track names, object payloads and manifests.

Theory of operation
-------------------
The authority is ``../shared/spec/kvcs-profile-draft.txt`` (the profile) and
``../shared/spec/KVSP-BINDING.md`` (what the profile takes from KVSP). The
modules here are pure functions and frozen values; the publisher and consumer
machines build on them. Bottom up:

* ``names``     the five-field Track Namespace and its discovery prefixes
                (profile 3.1, binding 4), the Track Name grammar (profile 3.2)
* ``payload``   the 68-octet object header, scatter/gather encoding and every
                End Subscriber check of an object payload (profile 3.5)
* ``manifest``  the manifest JSON model: strict parse, deterministic encode,
                validation, Compatibility ID consistency, version tracking
                (profile 3.6)
* ``cose``      the ``manifest.cose`` envelope: COSE_Sign1 with ES256 or EdDSA
                (profile 3.6, RFC 9052/9053); imports ``pycose``, so it is not
                imported here (import ``kvcs_core.kvcs.cose`` where needed)

Bad peer data never raises out of the checking functions: ``verify_object``
returns :class:`~kvcs_core.kvcs.payload.ObjectRejected`, ``verify_manifest``
returns :class:`~kvcs_core.kvcs.cose.ManifestRejected`, and the parsers raise
one typed ``ValueError`` subclass each (``KvcsNameError``, ``ManifestError``)
that the caller turns into a discard-and-report event (ARCHITECTURE.md, "Errors,
three tiers").
"""
