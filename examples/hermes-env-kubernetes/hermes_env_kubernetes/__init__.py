"""hermes-env-kubernetes: a third-party hermes-env backend that runs each environment in its own pod.

Kept light on purpose: ``plugin.py`` is imported whenever anyone lists
backends; ``backend.py`` (and with it the kubernetes SDK) only when the
``kubernetes`` backend is created.
"""
