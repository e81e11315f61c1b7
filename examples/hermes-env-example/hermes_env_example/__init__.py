"""hermes-env-example: a minimal third-party backend for hermes-env.

Kept empty on purpose: ``plugin.py`` is imported whenever anyone lists
backends, ``backend.py`` only when the ``example`` backend is created.
"""
