"""Safetensors shards on disk: header parsing, exact-offset reads, shard discovery (no model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import LowbitError
from pipeline.io import ShardWriter


class CheckpointError(LowbitError, ValueError):
    """A checkpoint that cannot be used as it is: corrupt, incomplete, or unsafe to unpickle."""


class CheckpointNotFoundError(LowbitError, FileNotFoundError):
    """A checkpoint directory, config.json or shard that is not there."""


SAFE_SINGLE, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN_SINGLE, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_MAX_HEADER = 100 << 20  # the safetensors format caps headers at 100 MB


Entry = tuple[torch.dtype, list[int], int, int]  # dtype, shape, first and end byte in the file


def read_safetensors_header(file: Path) -> dict[str, Entry]:
    """``{name: (dtype, shape, start, stop)}`` (absolute offsets) of one shard, checked to
    describe exactly the bytes on disk; else CheckpointError naming the file."""

    def corrupt(why: str) -> CheckpointError:
        return CheckpointError(f"corrupt safetensors file {file}: {why}; re-download or re-save it")

    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(size - 8, _MAX_HEADER):
            raise corrupt(f"header length {n} does not fit the file size {size}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        header.pop("__metadata__", None)
        entries = {}
        for name, meta in header.items():
            begin, stop = (int(x) for x in meta["data_offsets"])
            entries[name] = (_DTYPES[meta["dtype"]], [int(d) for d in meta["shape"]], begin, stop)
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError,
            ValueError) as err:  # fmt: skip
        raise corrupt(f"unreadable header ({err!r})") from err
    data, end, out = size - 8 - n, 0, {}
    for name, (dtype, shape, begin, stop) in entries.items():
        if begin < 0 or stop - begin != torch.Size(shape).numel() * dtype.itemsize:
            raise corrupt(f"tensor {name} spans {stop - begin} bytes, not {shape} x {dtype}")
        end = max(end, stop)
        out[name] = (dtype, shape, 8 + n + begin, 8 + n + stop)
    if end > data:  # the first tensor cut off names what an interrupted download lost
        cut = min((e for e in out.items() if e[1][3] > size), key=lambda e: e[1][2])[0]
        raise corrupt(
            f"truncated: tensor {cut} ends at byte {out[cut][3]} but the file holds {size}"
        )
    if end < data:  # the format forbids holes, so the last tensor must end at EOF
        raise corrupt(f"header expects {end} data bytes but the file holds {data}")
    return out


def tensor_locations(
    files: list[Path], index: Path | None, read_header=read_safetensors_header
) -> dict[str, tuple[Path, Any]]:
    """``{name: (file, header entry)}`` of every tensor in ``files``, from headers only; a
    tensor stored twice, missing from its shard or unlisted in ``index`` is a CheckpointError."""
    found: dict[str, tuple[Path, Any]] = {}
    for file in files:
        for name, entry in read_header(file).items():
            if name in found:
                raise CheckpointError(
                    f"tensor {name} is stored twice: in {found[name][0]} and {file}; "
                    "re-download or re-save the checkpoint"
                )
            found[name] = (file, entry)
    if index is None:
        return found
    listed = weight_map(index)
    mixed = "the index and the shards come from different checkpoints; re-download or re-save it"
    for name, shard in listed.items():
        if name not in found or found[name][0] != index.parent / shard:
            elsewhere = f" ({found[name][0].name} does)" if name in found else ""
            raise CheckpointError(
                f"{index} says {name} is in {shard}, but {index.parent / shard} does not hold "
                f"it{elsewhere}: {mixed}"
            )
    for name, (file, _) in found.items():
        if name not in listed:
            raise CheckpointError(f"{file} holds {name}, which {index} does not list: {mixed}")
    return found


def check_finite(t: torch.Tensor, name: str, file: Path | str, chunk: int = 1 << 24) -> None:
    """One line naming ``name`` and ``file`` when the floating tensor ``t`` holds NaN or Inf.

    ``aminmax`` is NaN/infinite when any value is, and allocates no mask as ``isfinite`` does.
    """
    if not t.is_floating_point() or t.numel() == 0 or t.is_meta:  # meta: offloaded, not loaded
        return
    flat = t.detach().reshape(-1)
    for s in range(0, flat.numel(), chunk):  # chunks bound the float32 copy of a float8 tensor
        part = flat[s : s + chunk]
        if part.element_size() == 1:  # float8 has no min/max kernels everywhere
            part = part.float()
        low, high = torch.aminmax(part)
        if not bool(torch.isfinite(low) & torch.isfinite(high)):
            break
    else:
        return
    bad = ~torch.isfinite(flat if flat.element_size() > 1 else flat.float())
    first, count = int(bad.nonzero()[0, 0]), int(bad.sum())
    at = [int(i) for i in torch.unravel_index(torch.tensor(first), t.shape)]
    raise CheckpointError(
        f"tensor {name} in {file} holds {count} NaN/Inf value{'s' * (count > 1)} (the first, "
        f"{float(flat[first])}, at {at}); the checkpoint is damaged: re-download it, or re-save "
        "it from a model without them"
    )


def read_tensors(file: Path, entries: dict[str, Entry]) -> dict[str, torch.Tensor]:
    """Read ``entries`` into fresh tensors; no memory map, whose pages would double the peak."""
    out = {}
    with open(file, "rb", buffering=0) as f:
        for name, (dtype, shape, start, stop) in sorted(entries.items(), key=lambda e: e[1][2]):
            t = torch.empty(shape, dtype=dtype)
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())  # the tensor's own bytes
            f.seek(start)
            got = 0
            while got < stop - start:  # one read() returns at most ~2 GiB on Linux
                k = f.readinto(view[got:])
                if not k:
                    raise CheckpointError(
                        f"corrupt safetensors file {file}: {name} ends past the end of the file "
                        "(truncated after opening?); re-download or re-save it"
                    )
                got += k
            out[name] = t
    return out


def load_bin(file: Path) -> dict[str, torch.Tensor]:
    # weights_only refuses arbitrary objects; mmap keeps the tensors on disk until copied.
    try:
        return torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # pickle, zip and legacy-format errors alike
        raise CheckpointError(f"cannot load {file}: {err}; re-save it as safetensors") from err


def read_json(file: Path) -> dict[str, Any]:
    try:
        return json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(
            f"{file} is not valid JSON ({err}); re-download or re-save it"
        ) from err


def weight_map(index: Path) -> dict[str, str]:
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index} has no 'weight_map'; re-download or re-save it")
    return weight_map


def weight_files(path: Path, allow_bin: bool) -> tuple[list[Path], Path | None, bool]:
    """Weight files of a checkpoint dir, its index file (if any), and whether they are pickles."""
    for index, single, is_bin in ((SAFE_INDEX, SAFE_SINGLE, False), (BIN_INDEX, BIN_SINGLE, True)):
        if (path / index).is_file():
            files = [path / name for name in dict.fromkeys(weight_map(path / index).values())]
        elif (path / single).is_file():
            files, index = [path / single], None
        elif not is_bin and (found := sorted(path.glob("*.safetensors"))):
            files, index = found, None
        else:
            continue
        if is_bin and not allow_bin:
            raise CheckpointError(
                f"{files[0]} is a pickled .bin checkpoint, which can run code when loaded; "
                "pass allow_bin=True to load it anyway (weights_only), or convert it once with "
                f"`python -m pipeline.models.shards {path} OUT_DIR` (writes safetensors)"
            )
        for file in files:
            if not file.is_file():
                raise CheckpointNotFoundError(f"shard {file} named in {path / index} is missing")
        return files, index and path / index, is_bin
    raise CheckpointNotFoundError(f"no {SAFE_SINGLE}, {SAFE_INDEX} or *.safetensors in {path}")


def convert_bin_to_safetensors(
    src: str | Path, dst: str | Path, shard_bytes: int = 5 << 30
) -> Path:
    """Rewrite a trusted ``pytorch_model*.bin`` checkpoint (and its small files) as safetensors
    shards, one input at a time."""
    import shutil

    src, dst = Path(src), Path(dst)
    files, _, _ = weight_files(src, allow_bin=True)
    writer = ShardWriter(dst, "model", shard_bytes)
    for file in files:
        for name, t in load_bin(file).items():
            writer.add(name, t.clone())  # tied weights share storage, which safetensors refuses
    writer.close()
    for extra in src.iterdir():
        if extra.is_file() and not extra.name.startswith("pytorch_model"):
            shutil.copy2(extra, dst / extra.name)
    return dst


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m pipeline.models.shards SRC_BIN_DIR OUT_DIR")
    print(convert_bin_to_safetensors(sys.argv[1], sys.argv[2]))
