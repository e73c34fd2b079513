"""The faces: ``load`` / ``aload`` / ``start_load``, the ``torch.distributed.checkpoint``
reader and planners, streaming and allocating reads, ``safe_open``, ``convert``. The public
names are re-exported by :mod:`asyncload`; import them from there."""
