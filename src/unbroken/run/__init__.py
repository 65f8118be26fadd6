"""What the training loop's Checkpointer remembers across its calls: the run's lineage
and id, its claim on the folder, its record (tracked metrics, the replay and health
checks, the optimizer watch), the idle-optimizer watch, retention and the trackers.

Imports ``core``, ``live``, ``format`` and ``storage``; only the Checkpointer (and the
integrations, for trackers) import it.
"""
