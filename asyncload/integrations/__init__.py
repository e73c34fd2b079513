"""Integrations of asyncload with training frameworks, one module each.

Nothing here is imported by ``import asyncload``: a module is imported (with the framework
it needs) only when the user imports it, e.g. ``asyncload.integrations.torchtitan``.
"""
