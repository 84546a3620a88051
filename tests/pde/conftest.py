import logging

import pytest


@pytest.fixture(autouse=True)
def _no_handlers_left_on_closed_streams():
    """The entry point's logging setup binds a handler to the stderr that pytest captures
    for one test; later tests that log without the entry point must not write to it."""
    yield
    logging.getLogger().handlers.clear()
