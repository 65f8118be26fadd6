"""The local tier: recent checkpoints in each node's memory, replicated on peer nodes
(docs/tiers.md). Same format and commit rule as the persistent tier; restored and
verified like any checkpoint."""
