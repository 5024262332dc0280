"""Real training-state shapes for `datastates bench --shape`, built from torch modules and optimizers.

Each builder returns a flat ``{key: tensor}`` dict (model ``state_dict()`` under ``model.``, optimizer
state under ``optim.<param index>.<name>``), every tensor with its own storage, so every peer (torch.save,
safetensors, DCP) can save it as is. ``scale`` multiplies the state's bytes while the tensor count and the
dtypes stay those of the full-size state: per-tensor costs are what these shapes are for.

- ``transformer``: ``nn.Embedding(16384, 768)`` + ``nn.TransformerEncoder`` of 12 layers of width 768
  (3072 feed-forward) + ``nn.LayerNorm``, AdamW state after one step (``exp_avg``, ``exp_avg_sq`` and a
  0-d fp32 ``step`` per parameter): 588 tensors, ~1.1 GiB at scale 1.
- ``cnn``: a ResNet-like stack of 26 conv3x3 + BatchNorm blocks in four stages (64..512 channels) and a
  linear head, SGD momentum buffers; the BatchNorm buffers include ``num_batches_tracked`` (0-d int64):
  238 tensors, ~141 MiB at scale 1.
- ``small``: 8,000 fp32 tensors of 64 KiB (``tensors`` overrides the count), ~500 MiB at scale 1.
- ``uniform``: 32 fp32 tensors of 32 MiB (``tensors`` overrides the count), 1 GiB at scale 1.

Weights are random (seeded), so nothing compresses or dedups by itself.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SHAPES = ("transformer", "cnn", "small", "uniform")
"""The shapes `--shape` accepts."""


def _flat(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The model's state_dict and the optimizer's per-parameter state as one flat dict of independent tensors."""
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
        for name, t in opt.state.get(p, {}).items():
            if hasattr(t, "clone"):
                out[f"optim.{i:04d}.{name}"] = t.detach().clone()
    return out


def _fake_step(model: torch.nn.Module, opt: torch.optim.Optimizer, g: torch.Generator) -> None:
    """One optimizer step on random gradients: the optimizer state a real step leaves, without a forward pass."""
    import torch

    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)


def _round(x: float, multiple: int, least: int) -> int:
    return max(least, int(round(x / multiple)) * multiple)


def transformer(scale: float = 1.0, seed: int = 0) -> dict[str, torch.Tensor]:
    """Embedding + 12-layer TransformerEncoder (width 768 at scale 1) with AdamW state after one step."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    f = math.sqrt(scale)  # bytes grow with width squared
    width = _round(768 * f, 12, 12)  # 12 heads
    vocab = _round(16384 * f, 16, 16)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            layer = nn.TransformerEncoderLayer(width, 12, 4 * width, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(width)

    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _fake_step(model, opt, torch.Generator().manual_seed(seed))
    return _flat(model, opt)


def cnn(scale: float = 1.0, seed: int = 0) -> dict[str, torch.Tensor]:
    """26 conv3x3 + BatchNorm blocks (64, 128, 256, 512 channels at scale 1) and a linear head, SGD momentum."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    f = math.sqrt(scale)
    layers: list[nn.Module] = []
    c_in = 3
    for width, blocks in ((64, 6), (128, 7), (256, 7), (512, 6)):
        c = _round(width * f, 4, 4)
        for _ in range(blocks):
            layers += [nn.Conv2d(c_in, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
            c_in = c
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, 1000)]
    model = nn.Sequential(*layers)
    g = torch.Generator().manual_seed(seed + 1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):  # the running statistics a few hundred training steps leave
            mean, var, count = m.running_mean, m.running_var, m.num_batches_tracked
            assert mean is not None and var is not None and count is not None  # track_running_stats=True
            mean.copy_(torch.randn(mean.shape, generator=g) * 0.1)
            var.copy_(1.0 + torch.rand(var.shape, generator=g) * 0.1)
            count.fill_(500)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _fake_step(model, opt, torch.Generator().manual_seed(seed))
    return _flat(model, opt)


def uniform(total: int, n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """`n` random fp32 tensors of about `total` bytes together (each a multiple of 64 bytes)."""
    import torch

    per = max(16, (total // n) // 64 * 16)  # fp32 elements, a multiple of 16 (64 bytes)
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i:04d}.weight": torch.randn(per, generator=g) for i in range(n)}


def approx_bytes(shape: str, scale: float = 1.0, tensors: int | None = None) -> int:
    """About how many bytes `build(shape, scale, tensors)` returns (for the disk-space check)."""
    full = {"transformer": 1.1 * 2**30, "cnn": 141 * 2**20, "small": (tensors or 8000) * (64 << 10),
            "uniform": (tensors or 32) * (32 << 20)}[shape]
    return int(full * scale)


def build(shape: str, scale: float = 1.0, tensors: int | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """The state of `shape` at `scale` (bytes multiplier); `tensors` overrides the count of small/uniform.

    Raises ValueError for an unknown shape or a scale that is not positive.
    """
    if not scale > 0:
        raise ValueError(f"--scale {scale} must be positive")
    if shape == "transformer":
        return transformer(scale, seed)
    if shape == "cnn":
        return cnn(scale, seed)
    if shape == "small":
        n = tensors or 8000
        return uniform(int(n * (64 << 10) * scale), n, seed)
    if shape == "uniform":
        n = tensors or 32
        return uniform(int(n * (32 << 20) * scale), n, seed)
    raise ValueError(f"--shape {shape!r} is unknown; choose from {', '.join(SHAPES)}")
