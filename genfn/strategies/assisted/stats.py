"""Acceptance statistics of speculative decoding, per row: what the output reports.

``proposed`` counts the valid drafts a row brought to verification, ``accepted`` those it kept,
``rounds`` its verification forwards; the acceptance rate is ``accepted / proposed`` and the
tokens per target forward ``(accepted + rounds) / rounds``. Rows that are finished or not
drafting are left out through ``active``.
"""

from __future__ import annotations

import torch

from genfn.state.base import pytree_dataclass

__all__ = ["AcceptanceStats", "init_stats", "record"]


@pytree_dataclass
class AcceptanceStats:
    proposed: torch.Tensor  # [B] int64
    accepted: torch.Tensor  # [B] int64
    rounds: torch.Tensor  # [B] int64

    def totals(self) -> dict:
        """The batch totals and rates as Python numbers (a host read: call it after generation)."""
        proposed, accepted, rounds = (int(t.sum()) for t in (self.proposed, self.accepted, self.rounds))
        return {"proposed": proposed, "accepted": accepted, "rounds": rounds,
                "acceptance_rate": accepted / proposed if proposed else 0.0,
                "tokens_per_round": (accepted + rounds) / rounds if rounds else 0.0}


def init_stats(batch: int, device=None) -> AcceptanceStats:
    zeros = torch.zeros(batch, dtype=torch.int64, device=device)
    return AcceptanceStats(proposed=zeros, accepted=zeros.clone(), rounds=zeros.clone())


def record(stats: AcceptanceStats, num_valid: torch.Tensor, accepted: torch.Tensor,
           active: torch.Tensor | None = None) -> AcceptanceStats:
    """Add one verification round (pure)."""
    on = torch.ones_like(stats.rounds, dtype=torch.bool) if active is None else active
    return AcceptanceStats(proposed=stats.proposed + torch.where(on, num_valid.to(torch.int64), 0),
                           accepted=stats.accepted + torch.where(on, accepted.to(torch.int64), 0),
                           rounds=stats.rounds + on.long())
