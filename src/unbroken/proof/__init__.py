"""The resume proof: tracked metrics, the post-resume health check, plots, and the
replay comparison behind ``unbroken.testing``.

Imports ``live`` and ``format`` (never ``core``, ``tools`` or ``cli``).
"""
