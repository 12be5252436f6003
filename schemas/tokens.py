"""The token contract the learner trains on: a trajectory's token streams (segments) and the check every
consumer of its arrays applies (the producer is `rollway.episode.stream.TokenStream`)."""

from __future__ import annotations

from rollway.schemas.messages import Trajectory


def segment_bounds(traj: Trajectory) -> list[tuple[int, int]]:
    """[start, end) of each token stream of the trajectory in `token_ids`: one for a built-in episode,
    one per segment for a harness episode whose program rewrote its history. The model saw each
    segment's tokens with that segment's own earlier tokens only, so each trains as its own sequence."""
    cuts = [0, *traj.segment_starts, len(traj.token_ids)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def check_token_arrays(traj: Trajectory) -> None:
    """The per-token invariants of `Trajectory` (what `TokenStream` guarantees): `loss_mask` and
    `logprobs` have the length of `token_ids`, every turn span lies inside it in order, the mask is
    1 exactly on the spans, and each segment start lies on a prompt token, in order. A violation is a producer bug: ValueError naming the episode."""
    n = len(traj.token_ids)
    if len(traj.loss_mask) != n or len(traj.logprobs) != n:
        raise ValueError(f"trajectory {traj.episode_id}: token_ids ({n}), loss_mask ({len(traj.loss_mask)}) "
                         f"and logprobs ({len(traj.logprobs)}) must have equal length")
    model = [0] * n
    last_end = 0
    for start, end in traj.turn_spans:
        if not last_end <= start <= end <= n:
            raise ValueError(f"trajectory {traj.episode_id}: turn span [{start}, {end}) out of order or outside "
                             f"its {n} tokens")
        model[start:end] = [1] * (end - start)
        last_end = end
    if traj.turn_spans and list(traj.loss_mask) != model:
        raise ValueError(f"trajectory {traj.episode_id}: loss_mask is not 1 exactly on the turns' completions")
    _check_segment_starts(traj, n)


def _check_segment_starts(traj: Trajectory, n: int) -> None:
    """Each later segment starts strictly inside the stream, after the previous one, and on its prompt:
    never inside or at the start of a turn's completion (nothing of its own would predict that token)."""
    last = 0
    for start in traj.segment_starts:
        if not last < start < n:
            raise ValueError(f"trajectory {traj.episode_id}: segment start {start} out of order or outside its "
                             f"{n} tokens (segment_starts {list(traj.segment_starts)})")
        if any(a <= start < b for a, b in traj.turn_spans):
            raise ValueError(f"trajectory {traj.episode_id}: segment start {start} falls on a turn's completion; "
                             "a segment opens with its prompt")
        last = start
