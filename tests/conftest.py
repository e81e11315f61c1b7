pytest_plugins = ["tests.support.ssh_fixtures"]
