"""Segment-wise streaming quantization of a checkpoint (the quantize stage's core).

The model is never materialised (DESIGN.md, "Segment-wise quantization"): the calibration
windows are embedded, then each segment of ``segment_size`` decoder blocks is read from the
safetensors shards, quantized block by block in GPTQ's sequential order
(:mod:`pipeline.quant.sequential`) on the inputs produced by the *already quantized* earlier
segments (so later layers compensate earlier rounding errors), run forward once more with its
quantized weights to produce the next segment's inputs, written as one output shard, and
freed. Peak memory is one segment, the activation cache (:mod:`pipeline.quant.actcache`,
spilled to a memory-mapped file beyond the budget) and one group's Hessian, whatever the depth.

Durability: after each segment its shard (``parts/``) and its output activations (``acts/``,
one file per rank) are committed to ``work_dir``, then a marker ``segments/NNNNN.json`` with
the segment's report. A killed run resumes after the last marker from the same activations,
hence with the same codes. With several ranks the calibration windows are split across ranks
(``dist.shard``), Hessians are all-reduced, every rank computes the same codes, rank 0 writes.

Trade-off: reading each block from disk and running the calibration set through it once per
linear group costs more time than quantizing a loaded model, in exchange for memory that does
not grow with depth.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from pipeline.dist import Dist
from pipeline.errors import LowbitError
from pipeline.models.adapters import linear_names
from pipeline.models.checkpoint import StreamingCheckpoint
from pipeline.models.quantized import QuantizedWriter
from pipeline.quant.actcache import ActivationCache
from pipeline.quant.formats import parse_format
from pipeline.quant.sequential import QuantOptions, block_groups, quantize_block

log = logging.getLogger("lowbit")


class _Head(nn.Module):
    """Final norm + lm_head, so the head is quantized like a one-linear block."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.norm(x))


class _Source:
    """Pieces of the model, streamed from the shards or (``stream=False``) from a fully loaded
    model, which is the reference the memory benchmark and the tests compare against."""

    def __init__(self, ckpt: StreamingCheckpoint, stream: bool) -> None:
        self.ckpt, self.a = ckpt, ckpt.adapter
        self.full = None if stream else ckpt.full_model().to(ckpt.device)

    def get(self, what: str, i: int = 0) -> nn.Module:
        if self.full is None:
            load = {"norm": self.ckpt.load_norm, "lm_head": self.ckpt.load_lm_head}
            return self.ckpt.load_block(i) if what == "block" else load[what]()
        name = {
            "norm": self.a.final_norm,
            "lm_head": self.a.lm_head,
            "block": self.a.block_prefix(i)[:-1],
        }[what]
        return self.full.get_submodule(name)


def _release_free_heap() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Each segment allocates and frees the same large tensors; glibc keeps freed chunks in its
    arenas, so without this the resident size creeps up segment after segment.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _finished_segments(work: Path, state: dict, n_seg: int) -> int:
    """Segments with a marker, or -1 when the work dir is from another setup (ranks, data)."""
    run_file = work / "run.json"
    if run_file.is_file() and json.loads(run_file.read_text()) != state:
        log.warning("quantize: %s is from another setup (inputs or ranks); starting over", work)
        return -1
    k = 0
    while k < n_seg and (work / "segments" / f"{k:05d}.json").is_file():
        k += 1
    return k


def _acts_file(work: Path, k: int, rank: int) -> Path:
    return work / "acts" / f"{k:05d}-rank{rank}.npy"


@torch.no_grad()
def quantize_checkpoint(
    src_dir: str | Path,
    out_dir: str | Path,
    plan: dict[str, str],
    calib: Tensor,
    *,
    method: str = "gptq",
    segment_size: int = 1,
    work_dir: str | Path,
    dist: Dist | None = None,
    act_budget_gb: float = 2.0,
    batch_size: int = 8,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    opts: QuantOptions | None = None,
    stream: bool = True,
    on_segment: Callable[[int], None] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Quantize a HF checkpoint segment by segment into a quantized model directory.

    Args:
        src_dir: FP checkpoint (config.json + safetensors shards).
        out_dir: The quantized model directory to write (rank 0).
        plan: ``{linear name: format}``; linears not listed stay float.
        calib: (N, T) token ids of all calibration windows (each rank takes its share).
        method: "gptq" or "rtn" (overrides ``opts.method``).
        segment_size: Decoder blocks per segment.
        work_dir: Persistent folder for committed segments (same path on every rank).
        dist: Ranks; None = a single process.
        act_budget_gb: Activation cache size above which it spills to a file in work_dir.
        batch_size: Calibration windows per forward pass.
        dtype, device: Compute dtype and device of the segment.
        opts: GPTQ settings.
        stream: False loads the whole model first (reference for tests and benchmarks).
        on_segment: Called with the index of each committed segment (tests simulate a crash).
        progress: Show a progress bar (rank 0 only).

    Returns:
        The quant report: ``{"layers": {name: {format, gptq_loss, rel_output_error, seconds}},
        "method", "segments", ...}``.
    """
    t_start = time.time()
    dist = dist or Dist()
    opts = dataclasses.replace(opts or QuantOptions(), method=method)
    work, budget = Path(work_dir), act_budget_gb * 2**30
    ckpt = StreamingCheckpoint(src_dir, dtype=dtype, device=device)  # checks every shard header
    raw = StreamingCheckpoint(src_dir)  # float tensors are copied in their stored dtype
    unknown = sorted(set(plan) - set(linear_names(ckpt.config)))
    if unknown:
        raise LowbitError(
            f"the quantization plan names layers the model does not have: "
            f"{unknown[:5]}; re-run allocate for this model"
        )
    for f in set(plan.values()):
        parse_format(f)
    a, n_layers = ckpt.adapter, ckpt.num_layers
    segments = [(s, min(s + segment_size, n_layers)) for s in range(0, n_layers, segment_size)]
    n_seg = len(segments)
    local = list(dist.shard(calib.shape[0]))
    ids = calib[local]  # (n, T) this rank's windows
    hidden = ckpt.config.hidden_size
    shape = (len(local), calib.shape[1], hidden)
    state = {
        "world_size": dist.world_size,
        "samples": list(calib.shape),
        "segments": [list(s) for s in segments],
        # What else decides the codes: a work dir reused with other inputs starts over.
        "inputs": hashlib.sha256(
            json.dumps(
                [str(Path(src_dir).resolve()), plan, dataclasses.asdict(opts), str(dtype)],
                sort_keys=True,
            ).encode()
            + calib.cpu().numpy().tobytes()
        ).hexdigest(),
    }  # as JSON reads it back
    start = dist.broadcast(_finished_segments(work, state, n_seg) if dist.is_main else None)
    # Resume only if every rank still has its activations of the last finished segment.
    ok = start <= 0 or _acts_file(work, start - 1, dist.rank).is_file()
    if dist.all_reduce_(torch.tensor([int(ok)], device=device)).item() < dist.world_size:
        start = -1
    dist.barrier()
    if dist.is_main:
        if start < 0:
            shutil.rmtree(work, ignore_errors=True)
        for sub in ("segments", "acts", "parts"):
            (work / sub).mkdir(parents=True, exist_ok=True)
        _write_json(work / "run.json", state)
    dist.barrier()
    start = max(start, 0)
    writer = QuantizedWriter(out_dir, parts_dir=work / "parts") if dist.is_main else None
    src = _Source(ckpt, stream)
    reduce = dist.all_reduce_ if dist.world_size > 1 else None
    slices = [slice(i, i + batch_size) for i in range(0, shape[0], batch_size)]

    if start == 0:
        # nn.Embedding is a row lookup: index the stored table (fp16 is half the fp32 copy).
        table = raw.tensor(a.embed + ".weight")  # (vocab, C)
        spill = work / "acts" / f"embed-rank{dist.rank}.npy"
        cache = ActivationCache.create(shape, dtype, budget, spill)
        for s in slices:
            cache[s] = table[ids[s]].to(dtype)
        if writer and not writer.has_part(0):
            writer.write_part(0, {a.embed + ".weight": table})
        del table
    else:
        cache = ActivationCache.load(_acts_file(work, start - 1, dist.rank), dtype, budget)
        log.info("quantize: resuming after %d finished segment(s) from %s", start, work)

    def batches_of(c: ActivationCache):
        return lambda: (c[s].to(ckpt.device) for s in slices)

    bar = tqdm(
        range(start, n_seg),
        desc="quantize segments",
        unit="seg",
        disable=dist.bar_disable(progress),
        initial=start,
        total=n_seg,
    )
    for k in bar:
        out = cache.for_outputs(_acts_file(work, k, dist.rank).with_suffix(".partial.npy"))
        seg_report, qtensors, floats = {}, {}, {}
        for i in range(*segments[k]):
            block, prefix = src.get("block", i), a.block_prefix(i)
            kwargs = ckpt.block_forward_inputs(calib.shape[1], layer_idx=i)
            formats = {n[len(prefix) :]: f for n, f in plan.items() if n.startswith(prefix)}
            groups = block_groups(a.linears, a.fused)
            qts, rep = quantize_block(
                block, formats, batches_of(cache), kwargs, groups, opts, reduce
            )
            for s in slices:  # outputs of the quantized block: the next block's inputs
                out[s] = block(cache[s].to(ckpt.device), **kwargs)
            cache = out
            qtensors.update({prefix + n: qt for n, qt in qts.items()})
            seg_report.update({prefix + n: r for n, r in rep.items()})
            skip = {prefix + n + ".weight" for n in qts}
            floats.update(
                {n: raw.tensor(n) for n in raw.names() if n.startswith(prefix) and n not in skip}
            )
            del block
        committed = cache.commit(_acts_file(work, k, dist.rank))
        if writer:
            writer.write_part(k + 1, floats, qtensors)
        del qtensors, floats
        _release_free_heap()
        dist.barrier()  # every rank's activations and rank 0's shard are on disk
        if dist.is_main:
            _write_json(work / "segments" / f"{k:05d}.json", {"segment": k, "layers": seg_report})
        dist.barrier()
        for old in (work / "acts").glob(f"*-rank{dist.rank}.npy"):
            if old != committed:
                old.unlink(missing_ok=True)  # the committed newer state supersedes it
        if on_segment is not None:
            on_segment(k)

    head_report = _finish_head(src, raw, plan, cache, batches_of, opts, reduce, writer, n_seg)
    layers: dict[str, dict] = {}
    for k in range(n_seg):
        layers.update(json.loads((work / "segments" / f"{k:05d}.json").read_text())["layers"])
    layers.update(head_report)
    overrides = {}
    if "lm_head" in plan and getattr(ckpt.config, "tie_word_embeddings", False):
        overrides["tie_word_embeddings"] = False  # the quantized head is its own tensor now
    if writer:
        writer.close(
            n_seg + 2, src_dir=src_dir, method=method, layers=plan, config_overrides=overrides
        )
    dist.barrier()
    return _summary(layers, method, n_seg, start, dist, calib, time.time() - t_start)


def _finish_head(src, raw, plan, cache, batches_of, opts, reduce, writer, n_seg) -> dict:
    """Final norm (float) and lm_head (quantized only if the plan lists it): the last part."""
    a = src.a
    floats = {a.final_norm + ".weight": raw.tensor(a.final_norm + ".weight")}
    qtensors, report = {}, {}
    if "lm_head" in plan:
        head = _Head(src.get("norm"), src.get("lm_head"))
        qtensors, report = quantize_block(
            head,
            {"lm_head": plan["lm_head"]},
            batches_of(cache),
            {},
            [("lm_head",)],
            opts,
            reduce,
        )
        del head
    elif a.lm_head + ".weight" in raw:
        floats[a.lm_head + ".weight"] = raw.tensor(a.lm_head + ".weight")
    if writer:
        writer.write_part(n_seg + 1, floats, qtensors)
    return report


def _summary(layers, method, n_seg, start, dist, calib, seconds) -> dict[str, Any]:
    bits = numel = 0
    for r in layers.values():
        out_f, in_f = r["shape"]
        bits += parse_format(r["format"]).bits_per_weight(in_f) * out_f * in_f
        numel += out_f * in_f
    errors = [r["rel_output_error"] for r in layers.values()]
    return {
        "method": method,
        "segments": n_seg,
        "resumed_segments": start,
        "world_size": dist.world_size,
        "calib_samples": int(calib.shape[0]),
        "calib_seq_len": int(calib.shape[1]),
        "quantized_layers": len(layers),
        "avg_bits": bits / numel if numel else 16.0,
        "mean_rel_output_error": sum(errors) / len(errors) if errors else 0.0,
        "max_rel_output_error": max(errors, default=0.0),
        "seconds": round(seconds, 3),
        "layers": layers,
    }
