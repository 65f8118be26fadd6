"""What is on disk: the tree codec, shard files, the manifest (built, sealed, read) and its
schema, fingerprints, the metrics record's lines, and the safe tensor reader.

Built on ``unbroken.storage`` (where the bytes are) and ``unbroken.errors``.
"""
