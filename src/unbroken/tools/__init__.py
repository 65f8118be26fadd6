"""Offline work on committed checkpoints: inspect, audit, coverage, diff, export, import,
and readers of foreign formats. Never imported by the library core; ``cli`` is their shell.
"""
