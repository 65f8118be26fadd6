"""One save, one restore (as its phases), post-restore verification, and the collectives
that make every rank reach the same decision. What a save asks of the run it belongs to
goes through one stated role (``saving.RunHooks``).

Imports ``live``, ``format``, ``storage``, ``errors`` and ``report``; never ``run``,
``proof``, ``tools`` or ``cli``.
"""
