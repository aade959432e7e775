"""What vLLM does with a failed kvtier load, by ``kv_load_failure_policy`` (said once, at start).

kvtier never changes the engine's setting. A load that fails (a chunk unreadable
after its lookup: a disk or remote error, a corrupt record, a peer gone) is
reported to vLLM as the blocks it left unfilled (``get_block_ids_with_load_errors``;
with several KV cache groups, as the request in ``failed_recving``), and kvtier
stores nothing computed over them. vLLM then applies its own policy
(``vllm.v1.core.sched.scheduler.Scheduler._handle_invalid_blocks``, vLLM 0.32):

- ``recompute``: the request is rewound to its first failed block and those tokens
  are prefilled again; the failed load is a miss and the answer is the cold one.
- ``fail`` (vLLM's default): the request finishes with ``FINISHED_ERROR`` (the
  client gets ``finish_reason="error"`` and no tokens for it).

Inside vLLM's ``MultiConnector`` the engine applies the MultiConnector's own
``kv_transfer_config`` setting; the copy a child connector receives carries only
the child's keys, so kvtier cannot read the engine's value there and says so.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("kvtier.vllm")

#: What a failed kvtier load does under each ``kv_load_failure_policy``.
OUTCOME = {
    "recompute": "a failed kvtier load is a miss: vLLM recomputes its blocks (same answer as cold)",
    "fail": "a failed kvtier load finishes the request with an error (finish_reason 'error'); "
            "set kv_transfer_config kv_load_failure_policy='recompute' to recompute it instead",
}


def failure_policy_message(kv_transfer_config: Any) -> str:
    """The start-up line: the policy this connector's ``kv_transfer_config`` names and its effect."""
    policy = str(getattr(kv_transfer_config, "kv_load_failure_policy", "fail"))
    outcome = OUTCOME.get(policy, f"vLLM decides (unknown policy {policy!r})")
    other = "; ".join(f"{p}: {o.split(';')[0]}" for p, o in OUTCOME.items() if p != policy)
    return (f"kvtier: kv_load_failure_policy={policy!r}: {outcome} (under {other}). kvtier leaves this "
            "setting as it is; inside vLLM's MultiConnector the MultiConnector's own setting applies")


def log_failure_policy(kv_transfer_config: Any) -> None:
    """Log :func:`failure_policy_message` at INFO (``recompute``) or WARNING (``fail``)."""
    policy = getattr(kv_transfer_config, "kv_load_failure_policy", "fail")
    log.log(logging.INFO if policy == "recompute" else logging.WARNING, failure_policy_message(kv_transfer_config))
