"""The one base of every protocol error kvtier raises (the lowest layer, so every layer can use it).

kvtier speaks several wire protocols, each with its own error class, each also deriving from the
standard exception its callers already catch:

================================================  =======================  =====================================
class                                             other base               raised for
================================================  =======================  =====================================
:class:`kvtier.protocol.errors.ProtocolError`     ``ValueError``           a control-plane frame or message (carries a ``code``)
:class:`kvtier.protocol.fleet.FleetProtocolError` ``ValueError``           a fleet (agent/controller) message
:class:`kvtier.tiers.resp.ProtocolError`          ``ConnectionError``      a byte stream that is not RESP (Redis)
:class:`kvtier.transfer.errors.ProtocolError`     ``TransferError``        a transfer-channel frame
================================================  =======================  =====================================

``except BaseProtocolError`` catches all of them; ``str()`` is the error's message.
"""

from __future__ import annotations


class BaseProtocolError(Exception):
    """A peer sent something its protocol does not allow (the base of every kvtier protocol error)."""
