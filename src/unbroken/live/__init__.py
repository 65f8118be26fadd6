"""Live objects <-> flat, FQN-keyed state: models, optimizers and other stateful objects,
RNG streams, the probe, and stop signals.

Imports ``format`` (dtypes, the tree codec) and ``errors``; never ``core`` or above.
"""
