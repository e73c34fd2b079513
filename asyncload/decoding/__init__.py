"""The decoding wing: checkpoint pickles decoded without running code from them.

``vm`` is the pickle machine (it knows no names); ``allowlist`` is the policy of what may be
rebuilt (``safe_loads``), with its ``tables``, ``numpy_data``, ``structure`` walk and the DCP
``dcp_checks``; ``scan`` reads a refused pickle whole with stand-ins (nothing imported or
called) so that one refusal names everything it needs; ``work`` counts what a decode did and
stops it at its budget. Importing this package imports none of its modules.
"""
