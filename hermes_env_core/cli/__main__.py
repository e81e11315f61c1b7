"""``python -m hermes_env_core.cli``: the same as the ``hermes-env`` console script."""

import sys

from . import main

sys.exit(main())
