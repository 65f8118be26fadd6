"""What is on disk: the tree codec, shard files, the manifest, the directory layout and its
atomic commit, fingerprints, and the safe tensor reader.

Imports nothing of ours but ``unbroken.errors``: everything above builds on it.
"""
