"""Process layouts of the fsdp and megatron backends, checked before any process starts.

Pure arithmetic on the configured sizes and the number of launched processes, plus the
model's ``config.json`` when ``model.name_or_path`` is a local directory or a built-in
tiny model already created (heads and layers that a tensor- or pipeline-parallel size must
divide). No torch at import: the launcher
runs these checks before it starts the workers (``reasonctl run --nproc-per-node N``),
and the backends repeat the fsdp one when they build their mesh.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def divisors(n: int) -> str:
    """``n``'s divisors as ``1, 2, 4``."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def fsdp_layout_problems(processes: int, *, dp_replicate: int, dp_shard: int, cp: int,
                         tp: int) -> list[str]:
    """Problems of ``[backend.fsdp]``'s mesh ``dp_replicate x dp_shard x cp x tp`` on
    ``processes`` processes, each naming its key and a value that fits."""
    for key, value in (("tp", tp), ("cp", cp)):
        if processes % value:
            return [f"backend.fsdp.{key}: {value} does not divide the {processes} processes; "
                    f"use one of {divisors(processes)}"]
    if processes % (cp * tp):
        return [f"backend.fsdp: cp ({cp}) x tp ({tp}) = {cp * tp} does not divide the "
                f"{processes} processes; lower cp or tp so that their product is one of "
                f"{divisors(processes)}"]
    data = processes // (cp * tp)
    where = f"the {data} data-parallel ranks" + (
        f" ({processes} processes / (cp {cp} x tp {tp}))" if cp * tp > 1 else "")
    if dp_shard <= 0:
        if data % dp_replicate:
            return [f"backend.fsdp.dp_replicate: {dp_replicate} does not divide {where}; "
                    f"use one of {divisors(data)}, or launch a multiple of "
                    f"{dp_replicate * cp * tp} processes"]
        return []
    if dp_replicate * dp_shard != data:
        fit = (f"dp_shard = -1 (here {data // dp_replicate})" if data % dp_replicate == 0
               else "dp_shard = -1 with a dp_replicate that divides them")
        return [f"backend.fsdp.dp_shard: dp_replicate ({dp_replicate}) x dp_shard "
                f"({dp_shard}) = {dp_replicate * dp_shard} must equal {where}; set {fit}"]
    return []


def fsdp_data_parallel_size(processes: int, *, cp: int, tp: int) -> int:
    """Data-parallel ranks of the fsdp backend: ``processes / (cp x tp)``."""
    return max(1, processes // (cp * tp))


def megatron_layout_problems(processes: int, *, tp: int, pp: int, vpp: int, device: str,
                             model: dict[str, Any] | None) -> list[str]:
    """Problems of megatron's ``dp x pp x tp`` on ``processes`` processes and ``model`` (a
    ``config.json`` dict, or ``None`` when not known yet), and of running it on ``device``."""
    problems = []
    if not cuda_usable(device):
        problems.append(
            f"backend.name: 'megatron' needs CUDA GPUs (megatron-core's schedules and gradient "
            f"buffers are CUDA-only) and backend.device is {device!r} on a machine "
            f"{'with' if cuda_present() else 'without'} CUDA; use --backend fsdp "
            "(backend.fsdp.tp for tensor parallelism) on CPU")
    problems += model_parallel_problems(processes, tp=tp, pp=pp)
    problems += model_split_problems(model, "backend.megatron.tp", tp)
    layers = (model or {}).get("num_hidden_layers")
    if isinstance(layers, int) and layers % (pp * vpp):
        problems.append(
            f"backend.megatron.pp: the model's {layers} layers (num_hidden_layers) do not "
            f"split into pp x vpp = {pp * vpp} equal stages; use a pp x vpp among "
            f"{divisors(layers)}")
    return problems


def model_parallel_problems(processes: int, *, tp: int, pp: int) -> list[str]:
    """The problem of megatron's ``tp x pp`` not dividing ``processes``, if it does not."""
    if processes % (tp * pp) == 0:
        return []
    return [f"backend.megatron: tp ({tp}) x pp ({pp}) = {tp * pp} does not divide the "
            f"{processes} processes; lower tp or pp so that their product is one of "
            f"{divisors(processes)}, or launch a multiple of {tp * pp} processes"]


def model_split_problems(model: dict[str, Any] | None, key: str, tp: int) -> list[str]:
    """The model sizes (``config.json`` values) that tensor parallelism of ``tp`` ranks
    must divide and does not, as one problem naming ``key``."""
    if tp <= 1 or not model:
        return []
    text = model.get("text_config") if isinstance(model.get("text_config"), dict) else model
    sizes = {name: text.get(name) for name in
             ("num_attention_heads", "num_key_value_heads", "intermediate_size")}
    bad = [f"{name} ({value})" for name, value in sizes.items()
           if isinstance(value, int) and value % tp]
    if not bad:
        return []
    fits = [d for d in range(1, tp) if all(not isinstance(v, int) or v % d == 0
                                         for v in sizes.values())]
    return [f"{key}: {tp} does not divide the model's {', '.join(bad)}; use a tp that "
            f"divides them, e.g. {fits[-1] if fits else 1}"]


def local_model_config(name_or_path: str) -> dict[str, Any] | None:
    """``config.json`` of a local model directory (or of a built-in tiny model already
    created); ``None`` for a hub name, a remote URI or an unreadable file (those are
    checked when the model loads)."""
    from reasonctl.models.tiny import TINY_ALIAS, TINY_VERSION, TINY_VL_ALIASES, cache_root

    directory = Path(name_or_path).expanduser()
    if name_or_path == TINY_ALIAS or name_or_path in TINY_VL_ALIASES:
        directory = cache_root() / f"{name_or_path}-{TINY_VERSION}"
    path = directory / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def cuda_present() -> bool:
    """Whether torch sees a CUDA device (imports torch)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def cuda_usable(device: str) -> bool:
    """Whether ``backend.device`` resolves to a CUDA device on this machine."""
    kind = device.partition(":")[0]
    if kind == "cuda":
        return cuda_present()
    return kind == "auto" and cuda_present()
