"""What is on disk: the tree codec, shard files, the manifest and its schema, fingerprints,
and the safe tensor reader.

Built on ``unbroken.storage`` (where the bytes are) and ``unbroken.errors``.
"""
