"""The resume proof: the run's record (tracked metrics, the replay check, the post-resume
health check), plots, and the replay comparison behind ``unbroken.testing``.

Imports ``core`` (collectives), ``live``, ``storage`` and ``format`` (never ``tools``
or ``cli``).
"""
