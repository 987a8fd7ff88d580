"""Explanations of single heads on real prompts: why a head attends where it does (``attend``: exact QK
attribution into pairs of upstream sources). Sits above ``_paths`` (path patching) and below ``_tasks`` (whose
roles quote it); reads the model only through ``_foundation`` (capture, the architecture adapters)."""
