"""One save, one restore (as its phases), post-restore verification, and the collectives
that make every rank reach the same decision.

Imports ``live``, ``format``, ``storage``, ``errors`` and ``report``; never ``proof``,
``tools`` or ``cli``.
"""
