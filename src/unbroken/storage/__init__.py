"""Where checkpoints are: one run-folder policy over two media (a local disk, an object store).

The public seam, the only modules the rest of the library imports from here:

- ``interface``: the roles (``Location``, ``Journal``, ``CheckpointDir``, ``RunLock``);
- ``locate``: a path or URL to its ``Location`` or run folder;
- ``names``: the names inside a run folder, the same on every medium.

Behind it: ``run_folder`` (the policy, written once, with its ``deleter``) over
``backend`` (the narrow protocol a medium implements), with ``local_medium`` /
``local_files`` / ``posix`` for a disk and ``store_medium`` / ``store_path`` / ``store`` /
``store_io`` for an fsspec store.
"""
