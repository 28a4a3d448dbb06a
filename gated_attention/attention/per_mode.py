"""One implementation for inference and another for the training step, chosen per mode.

A device run can time one kernel fastest for a forward alone and another for a forward with its
backward (tuning.py). PerMode runs `inference` where the call is not differentiated and
`training`'s forward and backward where it is: a custom VJP whose primal is the first and whose
forward rule is the second's (jax.vjp's function is a pytree of its residuals, so it is the
residual). Both must take the inputs; the outputs agree within the implementations' tolerances.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from gated_attention.attention import base, tuning
from gated_attention.core import platforms


@dataclasses.dataclass(frozen=True)
class PerMode(base.Implementation):
    """`inference` when the call is not differentiated, `training` when it is.

    Attributes:
      inference, training: the two implementations.
    """

    inference: base.Implementation
    training: base.Implementation

    # Positions-first and packed inputs reach each member as it takes them (base.run).
    TAKES = base.ALL_OPTIONS | {"positions_first", "packed"}

    @property
    def name(self) -> str:  # the record of what ran: both, by mode
        return f"{self.inference.name} (inference), {self.training.name} (training)"

    def plan(
        self,
        query,
        key,
        value,
        biases,
        mask,
        *,
        scale,
        compute_dtype,
        options=base.PLAIN,
        platform=None,
    ):
        """(inference's plan, training's plan): both must take the inputs."""
        return tuple(
            impl.plan(
                query,
                key,
                value,
                biases,
                mask,
                scale=scale,
                compute_dtype=compute_dtype,
                options=options,
                platform=platform,
            )  # fmt: skip
            for impl in (self.inference, self.training)
        )

    def __call__(
        self,
        query,
        key,
        value,
        biases,
        mask,
        *,
        scale,
        compute_dtype,
        options=base.PLAIN,
        plan=None,
    ):
        plans = (None, None) if plan is None else plan

        def call(which, q, k, v, b, mask, options):
            impl = (self.inference, self.training)[which]
            return base.run(
                impl, q, k, v, b, mask, scale=scale, compute_dtype=compute_dtype,
                options=options, plan=plans[which],
            )  # fmt: skip

        # mask and options (a pytree: the traced lengths) are arguments: a custom VJP must not
        # close over the caller's tracers.
        @jax.custom_vjp
        def attend(q, k, v, b, mask, options):
            return call(0, q, k, v, b, mask, options)

        def attend_fwd(q, k, v, b, mask, options):
            training = functools.partial(call, 1, mask=mask, options=options)
            return jax.vjp(training, q, k, v, b)

        def attend_bwd(vjp, cotangent):
            return (*vjp(cotangent), None, None)  # nothing flows to the mask or the lengths

        attend.defvjp(attend_fwd, attend_bwd)
        return attend(query, key, value, tuple(biases), mask, options)


def measured(impls, query, key, value, biases, mask, *, scale, compute_dtype, options, platform):
    """(implementation, plan, reason) that the GPU's table (tuning.py) measured fastest among
    `impls` for these inputs, built with the options the table records (a sweep's candidate), a
    PerMode where inference and training differ; None where the table has no entry or the
    winner does not take the inputs. An option is applied only to a field the instance leaves at
    its default: an instance the caller tuned (Auto(pallas=PallasAttention(block_q=32))) keeps
    its own."""
    kind = platforms.gpu_kind()
    length = max(query.shape[1], key.shape[1])
    dtype = jax.numpy.dtype(compute_dtype)
    found = tuning.choice(kind, dtype, query.shape[-1], length, tuning.bias_class(biases))
    by_name = {impl.name: impl for impl in impls}
    if found is None or not {c["implementation"] for c in found.values()} <= set(by_name):
        return None
    inference, training = (_tuned(by_name[found[m]["implementation"]], found[m]["options"])
                           for m in tuning.MODES)  # fmt: skip
    impl = inference if inference == training else PerMode(inference, training)
    try:
        plan = impl.plan(
            query, key, value, biases, mask, scale=scale, compute_dtype=compute_dtype,
            options=options, platform=platform,
        )  # fmt: skip
    except NotImplementedError:
        return None
    names = [found[m]["candidate"] for m in tuning.MODES]
    return (
        impl,
        plan,
        (
            f"measured fastest on {kind}: {names[0]} for inference, {names[1]} for "
            "training (tuning.json)"
        ),
    )


def _tuned(impl: base.Implementation, options: dict) -> base.Implementation:
    """impl with `options` set where its fields are at their defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(impl)}
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ValueError(
            f"tuning.json's options for {impl.name!r} must be fields of {sorted(defaults)}, got "
            f"{unknown}"
        )
    keep = {k: v for k, v in options.items() if getattr(impl, k) == defaults[k]}
    return dataclasses.replace(impl, **keep) if keep else impl
