"""What several test modules share: models, servers, configs and checks. Test modules import from here and
never from one another; pytest fixtures that several modules use live in tests/conftest.py."""
