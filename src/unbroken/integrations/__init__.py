"""Adapters that put a training framework's objects behind :class:`unbroken.Checkpointer`.

Each module imports its framework, so import the one you use, e.g.
``from unbroken.integrations.lightning import UnbrokenCallback``; ``import unbroken`` never
imports a framework.
"""
