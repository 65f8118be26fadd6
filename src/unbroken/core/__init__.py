"""One save, one restore, post-restore verification, and the collectives that make every
rank reach the same decision.

Imports ``live``, ``format``, ``errors`` and ``report``; never ``proof``, ``tools`` or ``cli``.
"""
