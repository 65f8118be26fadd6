"""Where checkpoints are: local folders and object stores, the commit, listing, locks.

Two roles (``interface.py``), each with a local and an object-store implementation;
``locate.py`` picks one for a path or URL.
"""
