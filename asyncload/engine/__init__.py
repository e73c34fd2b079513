"""The engine wing: one load's async core, below the faces and the distributed wing.

``config`` resolves the options once (:func:`~asyncload.engine.config.resolve_config`:
policies and the memory plan); ``session`` is the load (:class:`LoadSession`, made with its
collaborators) with ``records``, ``reads``, ``checks`` and ``cost`` as its jobs; ``driver``
runs the planner sequence over a session for 1..N ranks; ``plan`` and ``chunks`` say what to
read; ``pipeline`` reads it under the meters (``meter``: the one :class:`Meter`);
``assembly``, ``cuda``, ``transforms`` and ``crc`` put the bytes in place and check them.
Importing this package imports none of its modules.
"""
