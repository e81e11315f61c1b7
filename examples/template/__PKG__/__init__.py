"""__DIST__: the __NAME__ backend for hermes-env (``plugin.py`` is the entry point, ``backend.py`` the code)."""
