"""hermes-env: run an agent's shell commands anywhere, as if in one long-lived bash."""
