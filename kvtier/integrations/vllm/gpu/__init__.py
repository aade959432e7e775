"""vLLM on torch devices (CUDA GPUs; CPU tensors in tests): layout checks, block gathers, layer-wise copies.

Modules: :mod:`.layout` (read and check vLLM's KV layout), :mod:`.gather` (chunk plans,
index_select/index_copy_ gathers), :mod:`.streams` (CUDA copy stream or synchronous
stand-in), :mod:`.layerwise` (per-layer load/save ordering), :mod:`.steps` (the
worker's per-step loads and saves over these), :mod:`.server_copies` (the same loads and saves
copied by ``kvtier server`` by block id, when it accepts the KV over CUDA IPC). Nothing here has run on a GPU yet:
see README "vLLM on GPUs".
"""
