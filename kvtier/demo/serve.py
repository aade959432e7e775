"""``python -m kvtier.demo.serve``: vLLM's OpenAI server on this machine's CPU with kvtier connected,
on the demo's model unless ``--model`` names one (``scripts/serve.sh`` runs it).

A launcher, so it sits with the demo (it reads the demo's model folder); the command line and
environment it runs come from :class:`kvtier.integrations.vllm.serve.ApiServer`.
"""

from __future__ import annotations

import json
import os
import sys

from kvtier.integrations.vllm.serve import ApiServer, ServerSpec


def main(argv: list[str] | None = None) -> None:
    """``python -m kvtier.demo.serve [--port N] [--disk-path DIR] ... [vLLM args]``.

    Replaces this process with vLLM's OpenAI server on this machine's CPU, kvtier
    connected (CPU tier, plus a disk tier with ``--disk-path``). Arguments it does not
    know go to ``vllm.entrypoints.openai.api_server`` last (they win, e.g. ``--host 0.0.0.0``).
    Used by ``scripts/serve.sh``.
    """
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m kvtier.demo.serve",
        description="vLLM's OpenAI server with kvtier on this machine's CPU; unknown arguments go to vLLM.")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="model folder (default: the demo's SmolLM2-135M-Instruct)")
    p.add_argument("--disk-path", default=None, help="kvtier disk tier directory (default: none)")
    p.add_argument("--cpu-capacity", default="2GiB", help="kvtier CPU tier size")
    p.add_argument("--kvtier-config", default=None,
                   help="JSON object of more kvtier settings (kv_connector_extra_config)")
    p.add_argument("--no-kvtier", action="store_true", help="vLLM alone (no connector), for comparison")
    p.add_argument("--cpu-cores", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: every allowed core)")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=4096)
    args, rest = p.parse_known_args(argv)
    model = args.model
    if model is None:
        from kvtier.demo.model import prepare_model

        model = str(prepare_model().path)
    kvtier: dict | None = None
    if not args.no_kvtier:
        kvtier = {"cpu_capacity": args.cpu_capacity}
        if args.disk_path:
            kvtier["disk_path"] = args.disk_path
        if args.kvtier_config:
            kvtier.update(json.loads(args.kvtier_config))
    spec = ServerSpec(model=model, port=args.port, kvtier=kvtier, cpu_cores=args.cpu_cores,
                      num_gpu_blocks_override=args.num_gpu_blocks_override, max_model_len=args.max_model_len,
                      extra_args=rest)
    server = ApiServer(spec, log_path=os.devnull)
    argv_out = server.command()
    print("serve: " + " ".join(argv_out[1:]), file=sys.stderr, flush=True)
    os.execvpe(argv_out[0], argv_out, server.environment())


if __name__ == "__main__":
    main()
