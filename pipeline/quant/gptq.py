"""GPTQ: one-shot weight quantization with second-order error feedback (Frantar et al., 2023).

The error ||W X - Q X||^2 is quadratic in W with Hessian H = 2 X X^T / N. Columns are quantized in
turn; column q's rounding error goes onto the later columns through row q of the upper Cholesky
factor U of H^-1 = U^T U (the optimal OBS update): eagerly within a block, one matmul beyond it.
* lambda = damp * mean(diag H), x10 until H + lambda I factorises; dead inputs get H_ii = 1, w = 0.
* A group is fitted when its first column comes up, on its current (updated) weights; act_order
  permutes by decreasing H_ii, groups stay contiguous in the original order (no g_idx).
* Kept fp16 columns go last with error 0: they absorb the others' error, stored as updated.
* The loss 1/2 sum (w - q)^2 / U_qq^2 is the mean ||(W - Q) x||^2 over calibration x (lambda = 0).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from pipeline.quant.formats import Format, as_format
from pipeline.quant.qtensor import QTensor

MAX_DAMP_TRIES = 6


class HessianAccumulator:
    """Running H = 2/N * sum_n x_n x_n^T over the inputs of one linear layer."""

    def __init__(
        self,
        in_features: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        self.in_features = in_features
        self.H = torch.zeros(in_features, in_features, dtype=dtype, device=device)
        self.n_samples = 0

    @torch.no_grad()
    def add_batch(self, x: Tensor) -> None:
        """Add inputs x of shape (..., in_features); every leading index is one sample."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected inputs (..., {self.in_features}), got {tuple(x.shape)}")
        x = x.reshape(-1, self.in_features).to(device=self.H.device, dtype=self.H.dtype)
        n = x.shape[0]
        if n == 0:
            return
        total = self.n_samples + n
        self.H.mul_(self.n_samples / total).addmm_(x.T, x, alpha=2.0 / total)
        self.n_samples = total

    def merge(self, other: HessianAccumulator) -> None:
        """Fold in another accumulator (e.g. another rank), weighted by sample counts."""
        total = self.n_samples + other.n_samples
        if total == 0:
            return
        self.H.mul_(self.n_samples / total).add_(other.H.to(self.H), alpha=other.n_samples / total)
        self.n_samples = total


def _inverse_cholesky(H: Tensor, damp: float) -> Tensor:
    """Upper Cholesky factor U of (H + lambda I)^-1, raising lambda until it factorises."""
    mean_diag = H.diagonal().mean().abs().clamp_min(1e-12)
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    for attempt in range(MAX_DAMP_TRIES):
        d = damp if attempt == 0 else max(damp, 1e-3) * 10**attempt
        L, info = torch.linalg.cholesky_ex(H + d * mean_diag * eye)
        if info.item() == 0:
            U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
            if info.item() == 0 and torch.isfinite(U).all():
                if attempt:
                    warnings.warn(
                        f"Hessian not positive definite with damp={damp}; used damp={d:g}",
                        stacklevel=3,
                    )
                return U
    raise ValueError(
        f"Hessian is not positive definite even with damp={d:g}; the calibration "
        "inputs are degenerate: use more calibration samples or a larger damp"
    )


def gptq_quantize(
    w: Tensor,
    H: Tensor,
    fmt: Format | str,
    block_size: int = 128,
    damp: float = 0.01,
    act_order: bool = False,
    keep: Tensor | None = None,
) -> tuple[QTensor, float]:
    """Quantize a weight (out, in) given its Hessian (in, in); ``keep``: input columns in fp16."""
    fmt = as_format(fmt)
    n_out, n_in = w.shape
    if H.shape != (n_in, n_in):
        raise ValueError(f"Hessian shape {tuple(H.shape)} does not match weight in={n_in}")
    if not torch.isfinite(H).all():
        raise ValueError("Hessian contains NaN/Inf: check the calibration activations")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    H = H.detach().to(device=w.device, dtype=torch.float32)
    if fmt.kind == "float":
        qt = QTensor.from_float(w)
        delta = qt.dequantize() - w.detach().float()
        return qt, float(0.5 * ((delta @ H) * delta).sum())

    Wt, H, perm, kept = _permuted(w, H, act_order, keep)
    U = _inverse_cholesky(H, damp)  # (in, in) upper
    codes, p1, p2, losses = _quantize_columns(Wt, U, perm, kept, fmt, block_size)
    pos_of = torch.argsort(perm)
    codes = codes[pos_of].t()  # back to the original column order, (out, in)
    qt = QTensor.from_params(codes, fmt, p1, p2)
    if kept.any():
        qt = qt.with_kept(Wt[pos_of].t(), kept.nonzero().flatten())  # fp16-exact already
    return qt, float(0.5 * losses.sum())


def _permuted(
    w: Tensor, H: Tensor, act_order: bool, keep: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(W^T, H, perm: each position's original column, kept: column mask) in quantization order."""
    n_in = w.shape[1]
    # W^T makes a weight column a contiguous row: faster rank-1 updates on CPU.
    Wt = w.detach().float().t().contiguous()
    H = H.clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0
    Wt[dead] = 0.0
    if act_order:
        perm = torch.argsort(H.diagonal(), descending=True)
    else:
        perm = torch.arange(n_in, device=w.device)
    kept = torch.zeros(n_in, dtype=torch.bool, device=w.device)
    if keep is not None and len(keep):
        kept[torch.as_tensor(keep, dtype=torch.int64, device=w.device)] = True
        perm = torch.cat([perm[~kept[perm]], perm[kept[perm]]])
    return Wt[perm], H[perm][:, perm], perm, kept


def _quantize_columns(
    Wt: Tensor, U: Tensor, perm: Tensor, kept: Tensor, fmt: Format, block_size: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The GPTQ loop, updating ``Wt`` in place; codes (in, out) come back in permuted order."""
    n_in, n_out = Wt.shape
    device = Wt.device
    kept_at = kept[perm].tolist()
    pos_of = torch.argsort(perm)  # permuted position of each original column
    codec = fmt.codec
    G = fmt.group_len(n_in)
    group_of = (perm // G).tolist()
    p1 = torch.zeros(n_out, fmt.n_groups(n_in), device=device)
    p2 = torch.zeros_like(p1)
    rounders: dict[int, Callable[[Tensor], tuple[Tensor, Tensor]]] = {}
    codes = torch.empty(n_in, n_out, dtype=torch.int64, device=device)
    losses = torch.zeros(n_out, device=device)

    for i1 in range(0, n_in, block_size):
        i2 = min(i1 + block_size, n_in)
        W1 = Wt[i1:i2].clone()  # (B, out) current block, updated eagerly
        U1 = U[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            g = group_of[i1 + i]
            if g not in rounders:
                rows = pos_of[g * G : (g + 1) * G]  # permuted positions, all >= i1 + i
                wg = _current(Wt, W1, Err1[:i], U, rows, i1, i2)  # (G, out)
                p1[:, g], p2[:, g] = codec.fit(wg.t().contiguous())
                rounders[g] = codec.rounder(p1[:, g], p2[:, g])  # its tables, once
            col = W1[i]  # (out,)
            c, q = rounders[g](col)
            if kept_at[i1 + i]:  # stored exactly: only the fp16 rounding remains
                q = col.half().float()
                Wt[i1 + i] = q  # the final value of the column, read back by the caller
            codes[i1 + i] = c
            err = (col - q) / U1[i, i]
            losses += err.square()
            W1[i:].addr_(U1[i, i:], err, alpha=-1.0)
            Err1[i] = err
        Wt[i2:].addmm_(U[i1:i2, i2:].t(), Err1, alpha=-1.0)  # lazy update of later columns
    return codes, p1, p2, losses


def _current(
    Wt: Tensor, W1: Tensor, err: Tensor, U: Tensor, rows: Tensor, i1: int, i2: int
) -> Tensor:
    """Current weights (G, out) of permuted ``rows``: ``W1`` inside block [i1, i2), else ``Wt``
    minus the pending updates ``U[i1:i1+k, rows]^T @ err``."""
    inside = rows < i2
    out = Wt[rows] - U[i1 : i1 + err.shape[0], rows].t() @ err
    if inside.any():
        out[inside] = W1[rows[inside] - i1]
    return out
