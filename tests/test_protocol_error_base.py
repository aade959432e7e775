"""Every kvtier protocol error shares one base, and keeps the standard base its callers catch."""

from __future__ import annotations

import pytest

from kvtier.errors import BaseProtocolError
from kvtier.protocol.errors import ProtocolError as ControlPlaneError
from kvtier.protocol.fleet import FleetProtocolError
from kvtier.tiers.resp import ProtocolError as RespProtocolError
from kvtier.transfer.errors import ProtocolError as TransferProtocolError
from kvtier.transfer.errors import TransferError


@pytest.mark.parametrize(
    "exc, other",
    [
        (ControlPlaneError("bad_message", "m", 3), ValueError),
        (FleetProtocolError("m"), ValueError),
        (RespProtocolError("m"), ConnectionError),
        (TransferProtocolError("m", [True]), TransferError),
    ],
    ids=["control-plane", "fleet", "resp", "transfer"],
)
def test_one_base_and_the_old_one(exc: Exception, other: type[Exception]) -> None:
    assert isinstance(exc, BaseProtocolError) and isinstance(exc, other)
    assert str(exc) == "m"
    with pytest.raises(BaseProtocolError):
        raise exc


def test_each_keeps_its_attributes() -> None:
    e = ControlPlaneError("bad_message", "m", 3)
    assert (e.code, e.req_id) == ("bad_message", 3)
    assert TransferProtocolError("m", [True, False]).received == [True, False]
