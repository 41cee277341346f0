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
    trainer = Trainer(plugins=[QStatePrecision("bf16-true", states="int8", weights="bf16", error_feedback="eco")])

The conversion happens in ``connect()``, after ``configure_optimizers`` and the strategy's model
wrapping and before any checkpoint is loaded, so resumed runs load straight into the quantized
optimizer. The configuration comes from the constructor only (restored plugin state arrives too late).
With ``weights=`` (or ``error_feedback=``), ``connect()`` also rounds those parameters onto their grid; a resumed run
then loads the checkpoint's weights, which are on the grid already (the optimizer's rounding seed and step ride in
its state dict, so stochastic rounding of the weights resumes exactly).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from lightning.pytorch.plugins.precision import FSDPPrecision, HalfPrecision, MixedPrecision, Precision

from ..formats.weights import WeightBlock
from ..optim import ErrorFeedback, NonFiniteGradPolicy, QuantizationPolicy, QuantizedStates, StatesSpec, check_optimizer_parameters

PrecisionName = Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"]


class QStatePolicyMixin:
    """The optimizer conversion shared by every QState precision plugin."""

    policy: QuantizationPolicy

    def _set_policy(self, policy: QuantizationPolicy | None, arguments: dict[str, Any]) -> None:
        """``policy``, or one built from the policy keywords among ``arguments`` (the constructor's ``locals()``)."""
        self.policy = QuantizationPolicy.from_arguments(type(self).__name__, policy, arguments)

    def connect(self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], lr_schedulers: list[Any]):
        model, optimizers, lr_schedulers = super().connect(model, optimizers, lr_schedulers)
        check_optimizer_parameters(model, optimizers)
        quantized = [self.policy.apply(optimizer, model) for optimizer in optimizers]
        put_weights_on_grid(quantized)
        return model, quantized, lr_schedulers


def put_weights_on_grid(optimizers: list[torch.optim.Optimizer]) -> None:
    """Round the parameters that have a weight grid (``weights=``, ``error_feedback=``) onto it, as a run without master
    weights starts (``QuantizedStates.quantize_weights``, round to nearest: no random draw). At fit start only: a
    resumed run loads the checkpoint's weights afterwards, which a run with the same policy saved on the grid."""
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
            keep their dtype unless ``weight_overrides`` says otherwise. Formats that are not a dtype are held as grid
            values in the parameter's dtype (``"32-true"`` with ``weights="bf16"``: fp32 parameters holding bf16 values).
            The parameters are rounded onto their grid (round to nearest) when the plugin converts the optimizer.
        weight_rounding: ``"stochastic"`` (default) or ``"nearest"``, for writing the weights.
        weight_block: scale groups of block-scaled ``weights``: ``"row"`` (default), ``"tensor"`` or a power of two.
        error_feedback: what happens to the rounding error of the weights: ``None`` (dropped), ``"eco"`` (fed into the
            momentum, ECO's rule) or ``"eco_exact"`` (kept in an fp32 state ``"weight_error"``).
        weight_overrides: ``{name_pattern: weights}`` (``None``: the parameter's dtype), matched as ``overrides``,
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

    def __new__(cls, precision: PrecisionName = "32-true", *args: Any, **kwargs: Any):
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
    __doc__ = "``MixedPrecision`` (``16-mixed``/``bf16-mixed``) with quantized optimizer states." + _POLICY_DOC

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
