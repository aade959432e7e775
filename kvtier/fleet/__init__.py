"""The instance side of the fleet control plane (:mod:`kvtier.protocol.fleet`).

- :mod:`.agent`: :class:`FleetAgent`, one per kvtier instance (an embedded connector's
  worker, a ``kvtier server``): registers, resyncs, streams tier changes, heartbeats,
  runs the controller's operations.
- :mod:`.changes`: the bounded, coalescing queue between the storage managers'
  listeners and the agent thread.
- :mod:`.identity` (instance id, namespace and tier descriptions), :mod:`.namespaces`
  (the namespaces an agent serves), :mod:`.snapshots` (Snapshot parts), :mod:`.op_runner`
  (the pool that runs operations and refreshes health).
- (``kvtier server`` wires an agent and a KV event publisher in :mod:`kvtier.service.fleet_link`.)
"""

from kvtier.fleet.agent import FleetAgent, default_instance_id, namespace_info, tier_infos
from kvtier.fleet.changes import ChangeQueue

__all__ = ["ChangeQueue", "FleetAgent", "default_instance_id", "namespace_info", "tier_infos"]
