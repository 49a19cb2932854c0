"""Counters of speculative decoding: what was proposed, what the target accepted, where."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """``accepted_by_position[i]``: drafts accepted at position ``i`` (a draft is accepted only
    after every draft before it); ``proposed_by_position[i]``: drafts proposed there.
    ``verified_seqs``: sequences verified (each yields ``1 + accepted`` tokens)."""

    verify_steps: int = 0
    verified_seqs: int = 0
    proposed: int = 0
    accepted: int = 0
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    skipped_for_load: int = 0
    """Steps that would have speculated but ran more sequences than ``disable_by_batch_size``."""

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """One sequence's verification: ``num_accepted`` of its ``num_proposed`` drafts held."""
        self.verified_seqs += 1
        self.proposed += num_proposed
        self.accepted += num_accepted
        for counts, n in ((self.proposed_by_position, num_proposed), (self.accepted_by_position, num_accepted)):
            if len(counts) < n:
                counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1

    def as_dict(self) -> dict:
        rate = [a / p if p else 0.0 for a, p in zip(self.accepted_by_position, self.proposed_by_position)]
        return {"verify_steps": self.verify_steps, "verified_seqs": self.verified_seqs,
                "proposed": self.proposed, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                "acceptance_rate_by_position": rate, "accepted_by_position": list(self.accepted_by_position),
                "proposed_by_position": list(self.proposed_by_position),
                "mean_accepted_length": (1 + self.accepted / self.verified_seqs) if self.verified_seqs else 0.0,
                "draft_seconds": self.draft_seconds, "verify_seconds": self.verify_seconds,
                "skipped_for_load": self.skipped_for_load}
