"""GPTQ: one-shot weight quantization with second-order error feedback.

Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", ICLR 2023. For a linear layer with calibration inputs X, the layer-output
error ||W X - Q X||^2 is a quadratic in the weights with Hessian H = 2 X X^T / N. Columns are
quantized one at a time; the rounding error of column q is pushed onto the not yet quantized
columns through row q of the upper Cholesky factor U of H^-1 (H^-1 = U^T U), which is the
optimal (OBS) update. Updates inside a block of columns are applied eagerly, the rest
lazily as one matmul per block ("lazy batch updates"), which makes the algorithm
matmul-bound instead of memory-bound.

Choices made here:
* Dampening lambda = damp * mean(diag H). If H + lambda I is still not positive definite
  (numerically), lambda is raised 10x and the factorisation retried, with a warning.
* Dead inputs (H_ii = 0, never activated) get H_ii = 1 and weight 0, as in the reference.
* Group parameters are fitted (same grid search as RTN) on the *current*, error-updated
  weights of a group when its first column is reached. Unlike the reference, the group's
  columns include the pending lazy updates of the current block, so the fit sees exactly the
  weights it will quantize, whatever the block size.
* act_order quantizes columns by decreasing H_ii. Groups stay contiguous in the original
  column order (column j belongs to group j // G, so no g_idx is needed at export); a
  group's parameters are fitted when the first of its columns comes up in the permuted
  order, and the codes are un-permuted before they are stored.
* Fitting and rounding are the format codec's (``fmt.codec``), so every family gets the same
  feedback with its own rounding (exp: nearest LUT level).
* Kept columns (``keep``, SpQR-style outlier columns stored exactly in fp16) are quantized
  with error 0 (their fp16 rounding only) and go *last* in the column order: every other
  column's rounding error is then compensated onto them through the OBS update, and the
  compensated values are what is stored. Their codes are still written (the packed layout
  stays dense) but ``QTensor.keep_vals`` overrides them. Group parameters are fitted as usual.
* The returned loss is 1/2 * sum (w - q)^2 / [H^-1]_qq over all weights (the diagonal of
  the inverse of the still-unquantized sub-Hessian, i.e. U_qq^2). With H = 2 X X^T / N this
  is the mean over calibration samples of the squared layer-output error ||(W - Q) x||^2
  (exactly so for lambda = 0), which is the number reported per layer.
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
    """Running H = 2/N * sum_n x_n x_n^T over the inputs of one linear layer.

    Args:
        in_features: Input dimension of the layer.
        dtype: Accumulation dtype (float32 is enough for a running mean; float64 optional).
        device: Where H lives.
    """

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
        """Fold in another accumulator (e.g. from another rank), weighting by sample counts."""
        total = self.n_samples + other.n_samples
        if total == 0:
            return
        self.H.mul_(self.n_samples / total).add_(other.H.to(self.H), alpha=other.n_samples / total)
        self.n_samples = total


def _inverse_cholesky(H: Tensor, damp: float) -> Tensor:
    """Upper Cholesky factor U of (H + lambda I)^-1, raising lambda until it factorises."""
    mean_diag = H.diagonal().mean().abs().clamp_min(1e-12)  # scale of the dampening
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
    """Quantize a weight matrix with GPTQ.

    Args:
        w: Weight (out, in).
        H: Hessian (in, in), e.g. ``HessianAccumulator.H``.
        fmt: Format or format name.
        block_size: Columns per lazy-update block.
        damp: Relative dampening (fraction of mean diag(H)).
        act_order: Quantize columns in order of decreasing H_ii.
        keep: Optional input columns kept exactly in fp16 (see the module docstring).

    Returns:
        ``(qtensor, loss)`` with loss = 1/2 sum (w - q)^2 / [H^-1]_qq (see module docstring).
    """
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

    # Work on W^T (in, out): a weight column is then a contiguous row, which makes the
    # per-column rank-1 updates several times faster on CPU.
    Wt = w.detach().float().t().contiguous()  # (in, out), updated in place
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
        perm = torch.cat([perm[~kept[perm]], perm[kept[perm]]])  # kept columns last
    kept_at = kept[perm].tolist()  # whether each permuted position is kept
    pos_of = torch.argsort(perm)  # permuted position of each original column
    Wt, H = Wt[perm], H[perm][:, perm]
    U = _inverse_cholesky(H, damp)  # (in, in) upper

    codec = fmt.codec
    G = fmt.group_len(n_in)
    n_groups = fmt.n_groups(n_in)
    group_of = (perm // G).tolist()  # group of each permuted position
    p1 = torch.zeros(n_out, n_groups, device=w.device)
    p2 = torch.zeros_like(p1)
    rounders: dict[int, Callable[[Tensor], tuple[Tensor, Tensor]]] = {}  # group -> rounding
    codes = torch.empty(n_in, n_out, dtype=torch.int64, device=w.device)  # permuted, transposed
    losses = torch.zeros(n_out, device=w.device)

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
                Wt[i1 + i] = q  # the final value of the column, read back below
            codes[i1 + i] = c
            err = (col - q) / U1[i, i]
            losses += err.square()
            W1[i:].addr_(U1[i, i:], err, alpha=-1.0)
            Err1[i] = err
        Wt[i2:].addmm_(U[i1:i2, i2:].t(), Err1, alpha=-1.0)  # lazy update of later columns

    codes = codes[pos_of].t()  # back to the original column order, (out, in)
    qt = QTensor.from_params(codes, fmt, p1, p2)
    if kept.any():
        qt = qt.with_kept(Wt[pos_of].t(), kept.nonzero().flatten())  # fp16-exact already
    return qt, float(0.5 * losses.sum())


def _current(
    Wt: Tensor, W1: Tensor, err: Tensor, U: Tensor, rows: Tensor, i1: int, i2: int
) -> Tensor:
    """Current weights (G, out) of permuted columns ``rows`` while inside block [i1, i2).

    Columns in the block are up to date in ``W1``; later ones still miss this block's
    updates so far, ``U[i1:i1+k, rows]^T @ err`` (k = columns already quantized in the block).
    """
    inside = rows < i2
    out = Wt[rows] - U[i1 : i1 + err.shape[0], rows].t() @ err
    if inside.any():
        out[inside] = W1[rows[inside] - i1]
    return out
