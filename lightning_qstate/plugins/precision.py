"""Precision plugins that quantize the optimizer states of whatever LightningModule they are given.

``QStatePrecision(precision=..., states=..., ...)`` picks the right Lightning base for ``precision``:
``"32-true"`` (``Precision``), ``"16-mixed"``/``"bf16-mixed"`` (``MixedPrecision``, returned as
:class:`QStateMixedPrecision`), ``"16-true"``/``"bf16-true"`` (``HalfPrecision``, returned as
:class:`QStateHalfPrecision`). ``FSDPStrategy`` accepts only ``FSDPPrecision`` subclasses: use
:class:`QStateFSDPPrecision` there. Under ``ModelParallelStrategy`` (FSDP2) pass the plugin through
``Trainer(plugins=[...])``.

Example::

    trainer = Trainer(plugins=[QStatePrecision("bf16-mixed", states="int8", overrides={"*.wte.*": "fp32"})])
    # bf16 weights without fp32 master weights (ECO), int8 states:
    trainer = Trainer(plugins=[QStatePrecision("bf16-true", states="int8", rounding="stochastic", weights="bf16", error_feedback="eco")])

The conversion happens in ``connect()``, after ``configure_optimizers`` and the strategy's model
wrapping and before the optimizer states of a checkpoint are loaded, so resumed runs load straight into the quantized
optimizer. The configuration comes from the constructor only (restored plugin state arrives too late).
With ``weights=`` (or ``error_feedback=``), ``connect()`` also rounds those parameters onto their grid when a fit starts
without a checkpoint. A resumed run keeps the checkpoint's weights as they are (on the grid already; rounding a bf16
parameter's block grid again would move some of them by an ulp), and so do ``validate``/``test``/``predict`` (the
optimizer's rounding seed and step ride in its state dict, so stochastic rounding of the weights resumes exactly).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import FSDPPrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.trainer.states import TrainerFn

from ..formats.weights import WeightBlock
from ..optim import ErrorFeedback, NonFiniteGradPolicy, QuantizationPolicy, QuantizedStates, StatesSpec, check_optimizer_parameters
from .strategies import load_packed_checkpoints_into_shards

PrecisionName = Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"]


class QStatePolicyMixin:
    """The optimizer conversion shared by every QState precision plugin."""

    policy: QuantizationPolicy

    def _set_policy(self, policy: QuantizationPolicy | None, arguments: dict[str, Any]) -> None:
        """``policy``, or one built from the policy keywords among ``arguments`` (the constructor's ``locals()``)."""
        self.policy = QuantizationPolicy.from_arguments(type(self).__name__, policy, arguments)

    def connect(
        self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], lr_schedulers: list[Any]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer], list[Any]]:
        model, optimizers, lr_schedulers = super().connect(model, optimizers, lr_schedulers)
        check_optimizer_parameters(model, optimizers)
        quantized = apply_policy(self.policy, optimizers, model)
        module = next((module for module in model.modules() if isinstance(module, pl.LightningModule)), None)
        if module is not None and module._trainer is not None:
            load_packed_checkpoints_into_shards(module._trainer.strategy)
        if module is None or module._trainer is None or fit_starts_fresh(module._trainer):
            put_weights_on_grid(quantized)
        return model, quantized, lr_schedulers

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Also store the plugin's state (a GradScaler's) under the Lightning base's key, which Lightning's own plugin reads."""
        super().on_save_checkpoint(checkpoint)
        state = self.state_dict()
        if state:
            checkpoint[_lightning_base(self).__qualname__] = state

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the state Lightning's own plugin saved (``MixedPrecision``: the GradScaler's scale and growth tracker)
        where the checkpoint has none under this class's name (Lightning reads that one itself, afterwards)."""
        super().on_load_checkpoint(checkpoint)
        base = _lightning_base(self).__qualname__
        if type(self).__qualname__ not in checkpoint and base in checkpoint:
            self.load_state_dict(checkpoint[base])


def _lightning_base(plugin: Precision) -> type:
    """The Lightning precision class ``plugin`` extends (``MixedPrecision``, ``FSDPPrecision``, ...)."""
    return next(cls for cls in type(plugin).__mro__ if cls.__module__.startswith("lightning."))


def apply_policy(
    policy: QuantizationPolicy, optimizers: list[torch.optim.Optimizer], model: torch.nn.Module
) -> list[torch.optim.Optimizer]:
    """``policy.apply`` to each optimizer but one without param groups (Lightning's placeholder where
    ``configure_optimizers`` returns ``None``: nothing to quantize), which is left as it is."""
    return [policy.apply(optimizer, model) if optimizer.param_groups else optimizer for optimizer in optimizers]


# The temporary checkpoints of Lightning's tuners (LearningRateFinder, BatchSizeFinder: saved before their search,
# restored and deleted after it, in their on_fit_start, setting ``trainer.ckpt_path``).
TUNER_CHECKPOINT_PREFIXES = (".lr_find_", ".scale_batch_size_")


def is_tuner_checkpoint(path: object) -> bool:
    """Whether ``path`` is a tuner's temporary checkpoint (``TUNER_CHECKPOINT_PREFIXES``)."""
    return path is not None and os.path.basename(str(path)).startswith(TUNER_CHECKPOINT_PREFIXES)


def fit_starts_fresh(trainer: pl.Trainer) -> bool:
    """Whether ``trainer`` runs ``fit`` without a checkpoint to resume (not ``validate``, ``test`` or ``predict``), as
    the precision plugin's ``connect`` sees it (before any tuner callback restores its temporary checkpoint: a callback
    tells by the checkpoints it is given, ``QuantizedOptimizerStates.on_load_checkpoint``)."""
    return trainer.state.fn == TrainerFn.FITTING and not trainer.ckpt_path


def put_weights_on_grid(optimizers: list[torch.optim.Optimizer]) -> None:
    """Round the parameters that have a weight grid (``weights=``, ``error_feedback=``) onto it, as a run without master
    weights starts (``QuantizedStates.quantize_weights``, round to nearest: no random draw). Where a fit starts without a
    checkpoint only (:func:`fit_starts_fresh`): the rounding is not idempotent for bf16/fp16 parameters on a block grid, so
    the weights of a resumed run, or of a model after its fit, must not go through it again."""
    for optimizer in optimizers:
        if isinstance(optimizer, QuantizedStates):
            optimizer.quantize_weights()


_POLICY_DOC = """
    Args:
        states: one format for every state, or ``{state_name: format}`` (unnamed states stay fp32).
        rounding: ``"nearest"`` or ``"stochastic"``.
        block_size: values per scale (power of two); ``None`` for each format's default.
        min_quant_size: parameters with fewer elements (full shape) keep fp32 states.
        overrides: ``{name_pattern: states}``, matched with ``fnmatch`` against parameter names,
            e.g. ``{"*.wte.*": "fp32", "*.ln_*": "fp32"}`` (a pattern that matches no parameter raises).
        weights: the format parameters are kept in after each step, without fp32 master weights (ECO,
            ``optim/weights.py``): ``None`` (default: the parameter's dtype, torch's update), ``"bf16"``, ``"fp16"``,
            ``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"int8"``, ``"int4"`` or any ``eXmY``. It goes to the weights of the linear
            layers inside repeated blocks (``transformer.h.3.mlp.c_fc.weight``); embeddings, norms, biases and the head
            keep their dtype unless ``weight_overrides`` says otherwise (bf16/fp16 ones with ``weight_rounding`` and
            ``error_feedback`` on their dtype's grid, fp32 ones with torch's update). Formats that are not a dtype are held as grid
            values in the parameter's dtype (``"32-true"`` with ``weights="bf16"``: fp32 parameters holding bf16 values).
            The parameters are rounded onto their grid (round to nearest) when the plugin converts the optimizer.
        weight_rounding: ``"stochastic"`` (default) or ``"nearest"``, for writing the weights.
        weight_block: scale groups of block-scaled ``weights``: ``"row"`` (default), ``"tensor"`` or a power of two.
        error_feedback: what happens to the rounding error of the weights: ``None`` (dropped), ``"eco"`` (fed into the
            momentum, ECO's rule) or ``"eco_exact"`` (kept in an fp32 state ``"weight_error"``).
        weight_overrides: ``{name_pattern: weights}`` (``None``: the parameter's dtype; a bf16/fp16 one on its dtype's
            grid with ``weight_rounding`` and ``error_feedback``), matched as ``overrides``,
            e.g. ``{"*.lm_head.*": "bf16", "*.h.0.*": None}``.
        track_stalls: count stalled state entries, and weight entries whose update was lost to rounding (the pseudo-state
            ``"weights"``), read by ``StallMonitor``.
        nonfinite: for gradients holding inf/NaN: ``"skip"`` (default: those parameters are not updated, one warning per
            step names them), ``"skip_step"`` (no parameter is updated, as ``GradScaler`` does) or ``"raise"``.
        grads: a format the gradients are rounded to before each optimizer step (with ``rounding``), to test a gradient
            precision: ``None`` (default: left as they are), ``"bf16"``, ``"fp16"``, ``"fp8_e4m3"``, ``"e5m3"``, ``"int8"``,
            ... (any format name); every parameter of the optimizers, whatever its size. Param groups may set their own.
        policy: a :class:`~lightning_qstate.QuantizationPolicy` instead of the keywords above.
"""


class _PrecisionDispatch:
    """``QStatePrecision(precision)`` returns the subclass for ``precision``. This ``__new__`` lives in a base of
    its own because jsonargparse (LightningCLI) reads a class's arguments from a ``__new__`` the class itself
    defines, and would then accept none of ``__init__``'s options (``states`` etc.) in YAML configs."""

    def __new__(cls, precision: PrecisionName = "32-true", *args: Any, **kwargs: Any) -> QStatePrecision:
        if cls is QStatePrecision and precision != "32-true":
            variants = {
                "16-mixed": QStateMixedPrecision,
                "bf16-mixed": QStateMixedPrecision,
                "16-true": QStateHalfPrecision,
                "bf16-true": QStateHalfPrecision,
            }
            if precision not in variants:
                raise ValueError(f"QStatePrecision: precision={precision!r} is not supported; use one of {['32-true', *variants]}")
            cls = variants[precision]
        return super().__new__(cls)


class QStatePrecision(QStatePolicyMixin, _PrecisionDispatch, Precision):
    __doc__ = (
        """Quantized optimizer states with Lightning's precision ``precision`` (``"32-true"``, ``"bf16-true"``,
    ``"16-true"``, ``"bf16-mixed"``, ``"16-mixed"``: the matching variant is built for you). At the start of ``fit`` it
    converts each optimizer the LightningModule configured (``torch.optim.Adam``/``AdamW``/``SGD``/``Muon`` to
    ``QAdam``/``QAdamW``/``QSGD``/``QMuon``, any other through the generic wrapper) in place, keeping its param groups,
    learning-rate schedulers and state; checkpoints hold the codes and resume exactly.

    Example::

        import lightning.pytorch as pl
        from lightning_qstate.plugins import QStatePrecision

        plugin = QStatePrecision("bf16-mixed", states={"exp_avg": "int8", "exp_avg_sq": "int4"}, rounding="stochastic",
                                 overrides={"*.wte.*": "int8"})
        trainer = pl.Trainer(plugins=[plugin], max_steps=1000)

    or in a LightningCLI config: ``trainer.plugins: [{class_path: lightning_qstate.plugins.QStatePrecision,
    init_args: {precision: bf16-mixed, states: int8}}]`` (``examples/configs/``).
"""
        + _POLICY_DOC
    )

    def __init__(
        self,
        precision: PrecisionName = "32-true",
        *,
        states: StatesSpec = "int8",
        rounding: str = "nearest",
        block_size: int | None = None,
        min_quant_size: int = 4096,
        overrides: Mapping[str, StatesSpec] | None = None,
        weights: str | None = None,
        weight_rounding: str = "stochastic",
        weight_block: WeightBlock = "row",
        error_feedback: ErrorFeedback | None = None,
        weight_overrides: Mapping[str, str | None] | None = None,
        track_stalls: bool = False,
        nonfinite: NonFiniteGradPolicy = "skip",
        grads: str | None = None,
        policy: QuantizationPolicy | None = None,
    ) -> None:
        Precision.__init__(self)
        self._set_policy(policy, locals())


class QStateMixedPrecision(QStatePrecision, MixedPrecision):
    __doc__ = (
        "``MixedPrecision`` (``16-mixed``/``bf16-mixed``) with quantized optimizer states. Autocast follows the device "
        "the strategy put the model on (``device=`` fixes it), as Lightning's ``precision=`` does: a CPU Trainer on a "
        "machine with a GPU autocasts on the CPU." + _POLICY_DOC
    )

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"] = "bf16-mixed",
        device: str | None = None,
        scaler: torch.amp.GradScaler | None = None,
        *,
        states: StatesSpec = "int8",
        rounding: str = "nearest",
        block_size: int | None = None,
        min_quant_size: int = 4096,
        overrides: Mapping[str, StatesSpec] | None = None,
        weights: str | None = None,
        weight_rounding: str = "stochastic",
        weight_block: WeightBlock = "row",
        error_feedback: ErrorFeedback | None = None,
        weight_overrides: Mapping[str, str | None] | None = None,
        track_stalls: bool = False,
        nonfinite: NonFiniteGradPolicy = "skip",
        grads: str | None = None,
        policy: QuantizationPolicy | None = None,
    ) -> None:
        MixedPrecision.__init__(self, precision, device or ("cuda" if torch.cuda.is_available() else "cpu"), scaler)
        self._set_policy(policy, locals())
        self._follows_model = device is None  # the device is the model's, known in connect()
        self._own_scaler = scaler is None

    def connect(
        self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], lr_schedulers: list[Any]
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer], list[Any]]:
        """Take the autocast device (and the default GradScaler's) from the model the strategy moved to its device."""
        tensor = next(itertools.chain(model.parameters(), model.buffers()), None)
        if self._follows_model and tensor is not None and tensor.device.type != self.device:
            self.device = tensor.device.type
            if self.scaler is not None and self._own_scaler:
                self.scaler = torch.amp.GradScaler(device=self.device)
        return super().connect(model, optimizers, lr_schedulers)


class QStateHalfPrecision(QStatePrecision, HalfPrecision):
    __doc__ = "``HalfPrecision`` (``16-true``/``bf16-true``) with quantized optimizer states." + _POLICY_DOC

    def __init__(
        self,
        precision: Literal["16-true", "bf16-true"] = "bf16-true",
        *,
        states: StatesSpec = "int8",
        rounding: str = "nearest",
        block_size: int | None = None,
        min_quant_size: int = 4096,
        overrides: Mapping[str, StatesSpec] | None = None,
        weights: str | None = None,
        weight_rounding: str = "stochastic",
        weight_block: WeightBlock = "row",
        error_feedback: ErrorFeedback | None = None,
        weight_overrides: Mapping[str, str | None] | None = None,
        track_stalls: bool = False,
        nonfinite: NonFiniteGradPolicy = "skip",
        grads: str | None = None,
        policy: QuantizationPolicy | None = None,
    ) -> None:
        if precision not in ("16-true", "bf16-true"):  # HalfPrecision takes any other string for fp16
            raise ValueError(
                f"QStateHalfPrecision: precision={precision!r} is not supported; use '16-true' or 'bf16-true' "
                "(or QStatePrecision(precision), which picks the variant for any precision)"
            )
        HalfPrecision.__init__(self, precision)
        self._set_policy(policy, locals())


class QStateFSDPPrecision(QStatePolicyMixin, FSDPPrecision):
    __doc__ = (
        "``FSDPPrecision`` with quantized optimizer states, for ``FSDPStrategy`` (which accepts only FSDPPrecision). "
        "Checkpoints store the states as fp32 flat shards (FSDP reshapes them) and re-quantize on load.\n\n"
        "    Example::\n\n"
        '        trainer = Trainer(strategy=FSDPStrategy(), plugins=[QStateFSDPPrecision("bf16-mixed", states="int8")])\n'
        "        # on the CPU (gloo), lightning_qstate.plugins.CPUFSDPStrategy() in place of FSDPStrategy()\n" + _POLICY_DOC
    )

    def __init__(
        self,
        precision: PrecisionName = "32-true",
        scaler: Any = None,
        *,
        states: StatesSpec = "int8",
        rounding: str = "nearest",
        block_size: int | None = None,
        min_quant_size: int = 4096,
        overrides: Mapping[str, StatesSpec] | None = None,
        weights: str | None = None,
        weight_rounding: str = "stochastic",
        weight_block: WeightBlock = "row",
        error_feedback: ErrorFeedback | None = None,
        weight_overrides: Mapping[str, str | None] | None = None,
        track_stalls: bool = False,
        nonfinite: NonFiniteGradPolicy = "skip",
        grads: str | None = None,
        policy: QuantizationPolicy | None = None,
    ) -> None:
        FSDPPrecision.__init__(self, precision, scaler)
        self._set_policy(policy, locals())
