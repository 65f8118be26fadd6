"""The offline resume proof: the replay comparison behind ``unbroken.testing`` and
``unbroken resume-test`` (straight vs stopped and resumed), the resume lineage, the likely
cause of a difference, plots, and the runner of training commands.

Imports ``live``, ``format``, ``storage`` and ``errors``; never ``core``, ``run``,
``tools`` or ``cli``.
"""
