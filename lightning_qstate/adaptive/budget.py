"""The memory budget of the adaptive bit-width policy: stored bytes per format, each layer's ladder of options, and the
deterministic demotion/promotion passes that fit the average bits per state value under a cap (pure torch)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from ..arguments import ConfigurationError
from ..formats import StorageFormat
from ..optim.policy import resolve_format
from .zones import ZONES

FP32_BYTES = 4


class BudgetError(ConfigurationError):
    """The bit budget cannot be met even with every layer in its cheapest candidate formats (a ``ValueError``; the
    command line reports it as a usage error)."""


def format_nbytes(fmt: StorageFormat | None, numel: int, plain_bytes: int = FP32_BYTES) -> int:
    """Bytes a state of ``numel`` values takes in ``fmt`` (codes plus scales), or as a plain tensor of ``plain_bytes``
    per value (``None``)."""
    return plain_bytes * numel if fmt is None else fmt.nbytes(numel)


def resolved_nbytes(group: Mapping, state_name: str, param: torch.Tensor, numel: int, plain_bytes: int = FP32_BYTES) -> int:
    """Bytes of state ``state_name`` of ``param`` (``numel`` values in full) under ``group``'s policy (its ``states``
    spec, ``min_quant_size`` and block size), resolved as the optimizer resolves new states, FSDP2 row alignment included;
    a state kept plain takes ``plain_bytes`` per value (the optimizer's: the parameter's dtype, fp32 on a weight grid)."""
    return format_nbytes(resolve_format(group, state_name, param, numel), numel, plain_bytes)


Choice = tuple[str, ...]  # one format name per adapted state, in the order of the formats mapping


def zone_ladder(zone: str | None, formats: Mapping[str, Mapping[str, str]], nbytes: Callable[[str, str], int]) -> list[tuple[Choice, int]]:
    """A layer's options, from its zone's formats down to the cheapest, as ``[(choice, bytes), ...]`` with
    strictly falling bytes.

    ``formats`` is ``{state name: {zone: format name}}``; ``nbytes(state, format name)`` prices one state of
    this layer. The options are the formats of ``zone`` (``None``: ``critical``), of each lower-priority
    zone, then the floor: the cheapest candidate of each state. Options that save nothing are skipped.
    """
    start = ZONES.index(zone) if zone is not None else 0
    options = [tuple(per_zone[z] for per_zone in formats.values()) for z in ZONES[start:]]
    options.append(
        tuple(min(dict.fromkeys(per_zone.values()), key=lambda name, s=state: nbytes(s, name)) for state, per_zone in formats.items())
    )
    ladder: list[tuple[Choice, int]] = []
    for choice in options:
        cost = sum(nbytes(state, name) for state, name in zip(formats, choice, strict=False))
        if not ladder or cost < ladder[-1][1]:
            ladder.append((choice, cost))
    return ladder


def budget_ladder(
    zone: str | None, formats: Mapping[str, Mapping[str, str]], nbytes: Callable[[str, str], int]
) -> tuple[list[tuple[Choice, int]], int]:
    """A layer's options for the budget, ``(ladder, start)``: :func:`zone_ladder` of ``zone`` (which starts at rung
    ``start``) under the options a budget with room to spare may promote it to: the formats of each higher-priority
    zone, from the next one up to ``critical``, each kept only if it costs more than every option below it.
    The bytes still fall strictly down the ladder; ``start`` is 0 for ``critical`` (and ``None``)."""
    below = zone_ladder(zone, formats, nbytes)
    above: list[tuple[Choice, int]] = []
    for z in reversed(ZONES[: ZONES.index(zone) if zone is not None else 0]):
        choice = tuple(per_zone[z] for per_zone in formats.values())
        cost = sum(nbytes(state, name) for state, name in zip(formats, choice, strict=False))
        if cost > (above[-1][1] if above else below[0][1]):
            above.append((choice, cost))
    return above[::-1] + below, len(above)


def floor_option(
    lowest: tuple[Choice, int], states: Sequence[str], floor_formats: Mapping[str, str], nbytes: Callable[[str, str], int]
) -> tuple[Choice, int] | None:
    """The last-resort option below a ladder whose cheapest option is ``lowest`` (``(choice, bytes)``): each state of
    ``states`` named in ``floor_formats`` in that format where it is cheaper, the others as in ``lowest``; ``None``
    where that saves nothing. :func:`fit_budget` takes it as a ``reserve`` rung."""
    choice = tuple(
        min((name, floor_formats.get(state, name)), key=lambda candidate, s=state: nbytes(s, candidate))
        for state, name in zip(states, lowest[0], strict=True)
    )
    cost = sum(nbytes(state, name) for state, name in zip(states, choice, strict=True))
    return (choice, cost) if cost < lowest[1] else None


def budget_order(zones: Sequence[str | None], numels: Sequence[int], names: Sequence[str]) -> list[int]:
    """Layer indices in the budget's order (:func:`fit_budget`'s ``order``): the lowest-priority zone first (``None``,
    before any check, counts as ``critical``), then the largest, then by name. Demotions start from the first, and so
    do promotions: the least precise layers get the room under the cap first."""
    return sorted(range(len(zones)), key=lambda i: (-ZONES.index(zones[i] or ZONES[0]), -numels[i], names[i]))


def fit_budget(
    ladders: Sequence[Sequence[int]],
    fixed_bytes: int,
    values: int,
    target_bits: float | None,
    order: Sequence[int],
    start: Sequence[int] | None = None,
    fill: bool = True,
    reserve: Sequence[int] | None = None,
) -> list[int]:
    """Which rung of each layer's ladder to use so that the average bits per state value is at most ``target_bits``,
    and with ``fill`` greedily close to it.

    Args:
        ladders: per layer, the bytes of its options, falling.
        fixed_bytes: bytes of states that are not adapted (pinned by a user override).
        values: number of state values over everything counted, adapted or not.
        target_bits: the cap, scales included; ``None`` for none.
        order: layer indices, first to be demoted first and promoted first (lowest priority zone, then largest, then name).
        start: per layer, the rung its zone asks for (default: 0 for every layer); rungs above it are promotions.
        fill: run the promotion pass (2. below); ``False``: demotions only, the plan stays wherever they leave it.
        reserve: per layer, how many of its last rungs are a last resort (the planner's ``floor_formats``): the budget
            is first fitted without them, and only if that raises :class:`BudgetError` with them (default: none).

    Two passes, deterministic and linear in layers times rungs:

    1. demotion: each layer in ``order`` is demoted from its ``start`` rung by rung to its floor before the next
       one is touched, until the total fits;
    2. promotion (the cap's slack): in rounds, each layer in ``order`` (the least precise first: the lowest
       priority zone, then the largest) is promoted one rung if the total stays within the cap, until no layer
       can move up (rung 0, or its next rung does not fit: it never will, the total only grows). One rung per
       layer per round spreads the slack over many layers' first upgrades before any layer's second, and the
       order gives it to the layers with the fewest bits first: with the default formats a redundant layer's
       first rung is its ``v`` to 8 bits, a magnitude layer's its ``m``, and on the GPT benchmark a 4-bit ``v``
       costs more than a 4-bit ``m`` (10 seeds against fixed int8: ``m`` int4 + ``v`` int8 +0.07 %, ``m`` int8 +
       ``v`` int4 +1.70 %; ``benchmarks/results/adaptive_bits_gpt_seeds.md``).

    Without a cap every layer stays at its ``start`` rung.

    Raises:
        BudgetError: even every layer at its floor (reserved rungs included) exceeds ``target_bits``.
    """
    if reserve is not None and any(reserve):
        try:
            unreserved = [ladder[: len(ladder) - kept] for ladder, kept in zip(ladders, reserve, strict=True)]
            return fit_budget(unreserved, fixed_bytes, values, target_bits, order, start, fill)
        except BudgetError:
            pass  # the reserved rungs are needed
    chosen = [0] * len(ladders) if start is None else list(start)
    total = fixed_bytes + sum(ladder[rung] for ladder, rung in zip(ladders, chosen, strict=False))
    if target_bits is None:
        return chosen
    cap = target_bits * values / 8
    for index in order:
        ladder = ladders[index]
        while total > cap and chosen[index] + 1 < len(ladder):
            total += ladder[chosen[index] + 1] - ladder[chosen[index]]
            chosen[index] += 1
    if total > cap:
        raise BudgetError(
            f"target_bits={target_bits} cannot be met: the cheapest candidates give {8 * total / values:.3f} bits per state value "
            f"over {values} values (states kept plain included)"
        )
    candidates = [index for index in order if chosen[index] > 0] if fill else []
    while candidates:  # one round: each candidate up one rung; the total only grows, so a refused rung stays refused
        kept = []
        for index in candidates:
            step = ladders[index][chosen[index] - 1] - ladders[index][chosen[index]]
            if total + step <= cap:
                total += step
                chosen[index] -= 1
                if chosen[index] > 0:
                    kept.append(index)
        candidates = kept
    return chosen
