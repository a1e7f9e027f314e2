import pytest

from tests.workers.kv_connectors.transfer.test_kv_transfer_zmq import Link


@pytest.fixture(autouse=True)
def _close_links():
    yield
    Link.close_all()
