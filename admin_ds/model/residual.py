"""Residual connections: the seam where Post-LN, Admin, DeepNorm and T-Fixup differ.

A sub-layer combines its shortcut ``x`` (B, T, D) with its branch output ``y = f(x)`` (B, T, D):

    PlainResidual     x + y                 default Post-LN / Pre-LN, T-Fixup
    OmegaResidual     omega * x + y         Admin (omega profiled) and admin-torch's constant
    ScaledResidual    alpha * x + y         DeepNorm (alpha a fixed scalar)

``*`` is element-wise; omega is a D-vector. With omega = 1 Admin is exactly the standard Post-LN
Transformer, which a test checks bit for bit.

Every residual knows where it sits: ``stack`` ("encoder" | "decoder") and ``index``, 1-based
within the stack in forward order (encoder layer l holds 2l+1, 2l+2; decoder layer l holds
3l+1, 3l+2, 3l+3), which is the numbering of the reference ``profile.ratio.init`` file.

Profiling hooks in here: while a recorder is attached (``attach_recorder``), ``forward`` hands
``(self, x, y)`` to it and returns what it returns, so the recorder can both measure the
statistics and decide which omega the forward pass uses (the reference recursion fills omega
sub-layer by sub-layer *within* one pass).
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch
from torch import nn

Recorder = Callable[["Residual", torch.Tensor, torch.Tensor], torch.Tensor]


class Residual(nn.Module):
    """Base class: ``forward(x, y)`` combines shortcut and branch output."""

    def __init__(self, stack: str, index: int) -> None:
        super().__init__()
        self.stack = stack
        self.index = index
        self.recorder: Optional[Recorder] = None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.recorder is not None:
            return self.recorder(self, x, y)
        return self.combine(x, y)

    def combine(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def shortcut_scale(self) -> Optional[torch.Tensor]:
        """The factor applied to x, as a tensor broadcastable to D, or None for 1 (plain)."""
        return None

    def reset_parameters(self) -> None:
        """Constants set at construction, set again (a model built on the meta device)."""

    def extra_repr(self) -> str:
        return f"stack={self.stack}, index={self.index}"


class PlainResidual(Residual):
    def combine(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


class OmegaResidual(Residual):
    """Admin's shortcut scale, ``omega * x + y`` with omega a D-vector (Liu et al. 2020, eq. 6).

    The state_dict entry is named ``omega`` (DESIGN.md: omega parameters are the entries whose
    names end in ``omega``). A fixed omega is a buffer, which the optimizer never sees.
    """

    def __init__(self, dim: int, stack: str, index: int, init_value: float = 1.0,
                 trainable: bool = True) -> None:
        super().__init__(stack, index)
        self.dim, self.init_value = dim, float(init_value)
        value = torch.full((dim,), self.init_value)
        if trainable:
            self.omega = nn.Parameter(value)
        else:
            self.register_buffer("omega", value)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.omega.fill_(self.init_value)

    def combine(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.omega * x + y

    def shortcut_scale(self) -> torch.Tensor:
        return self.omega

    @torch.no_grad()
    def set_omega(self, value: torch.Tensor | float) -> None:
        """Write omega into this module's tensor (not into an optimizer's master copy:
        admin_ds.train.engine.write_omega owns that, since only it knows the optimizer)."""
        self.omega.copy_(torch.as_tensor(value, dtype=self.omega.dtype).expand_as(self.omega))


class ScaledResidual(Residual):
    """DeepNorm's ``alpha * x + y`` with a fixed scalar alpha (a buffer so it travels with the
    model and folds like omega)."""

    def __init__(self, dim: int, stack: str, index: int, alpha: float) -> None:
        super().__init__(stack, index)
        self.init_value = float(alpha)
        self.register_buffer("alpha", torch.full((dim,), self.init_value))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.alpha.fill_(self.init_value)

    def combine(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.alpha * x + y

    def shortcut_scale(self) -> torch.Tensor:
        return self.alpha


def iter_residuals(model: nn.Module) -> Iterator[Residual]:
    """All residual modules of a model, encoder stack first, each in forward order."""
    found = [m for m in model.modules() if isinstance(m, Residual)]
    order = {"encoder": 0, "decoder": 1}
    return iter(sorted(found, key=lambda r: (order[r.stack], r.index)))


class attach_recorder:
    """Context manager: route every residual of ``model`` through ``recorder`` while active."""

    def __init__(self, model: nn.Module, recorder: Recorder) -> None:
        self.residuals = list(iter_residuals(model))
        self.recorder = recorder

    def __enter__(self) -> "attach_recorder":
        for r in self.residuals:
            r.recorder = self.recorder
        return self

    def __exit__(self, *exc) -> None:
        for r in self.residuals:
            r.recorder = None
