"""The FSDP2-equivalent runtime: what torch's ``_fully_shard/`` does, in its shape.

``fully_shard`` (``_fully_shard``) builds units (``_unit``, ``_flat_buffer``,
``_reduce``, ``_sharded_param``) and hooks (``_hooks``); the hooks drive the root's
scheduler (``_scheduler``), the scheduler the units, the units the collectives
(``_collectives``), which report to the root's observers (``_events``). Private:
``fsdp_compose/__init__.py`` is the public surface.
"""
