"""Offline work on committed checkpoints, public as ``unbroken.inspect_checkpoint``,
``verify_checkpoint``, ``diff_checkpoints``, ``export_checkpoint`` and
``import_checkpoint`` (docs/api.md); ``cli`` is their shell.

One module per tool (inspection, verification, comparison, exporting, importing), on
shared pieces: which folders a path means (folders), what a manifest's components hold
(contents), the optimizer's coverage of the model (coverage, tying), the results' JSON
form and progress (reporting), and readers of foreign formats (foreign, dcp_metadata,
optimizer_mapping). Never imported by the library core.
"""
